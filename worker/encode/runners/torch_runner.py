"""`TorchRunner`: a Hugging Face encoder run by torch, eager or as a checked TorchScript trace."""

from __future__ import annotations

from worker.encode.runners.torch_base import TorchModuleRunner
from worker.models import ModelFiles


class TorchRunner(TorchModuleRunner):
    """A transformers encoder with the pooling its sentence-transformers config asks for."""

    def __init__(
        self,
        files: ModelFiles,
        *,
        device: str = "cpu",
        threads: int | None = None,
        torchscript: bool = False,
        dtype: str = "float32",
    ) -> None:
        import torch
        from transformers import AutoModel

        from worker.encode.runners.encoder import Encoder

        if threads:
            torch.set_num_threads(threads)
        model = AutoModel.from_pretrained(files.path, dtype=getattr(torch, dtype))
        model = model.to(torch.device(device)).eval()
        super().__init__(model, files, device)
        self.dim = int(model.config.hidden_size)
        self._module = Encoder(model, files.pooling).eval()
        if torchscript:
            self._trace(model, files)
