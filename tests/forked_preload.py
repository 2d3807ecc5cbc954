"""What the forkserver of `tests/forked.py` imports once, so each fork starts with it loaded
(a cold process spends hundreds of ms to seconds on each). Only that server imports this.

The environment a library reads at import is fixed here for every fork: the test processes
never reach the hub (`process_env` says the same to cold ones)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import fastapi  # noqa: F401
import httpx  # noqa: F401
import redis  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import uvicorn  # noqa: F401

import common.cli  # noqa: F401
