"""Garbage collection for a serving process: rare young collections, a frozen startup heap.

A request allocates and frees thousands of small objects, nearly all freed by reference
counting; with CPython's default threshold (700 net container allocations) the gateway still
ran a young collection every few requests and a full one every few seconds, about a ninth
of its time under load (`benchmarks/queue_path.py`, 64 connections: 4,867 collections and
1.99 s of 13 s). A threshold of 50,000 keeps what cycles there are collected, at a
bound of a few MB, and `freeze` moves what startup built (modules, settings, the model's
Python objects) out of every later full collection's scan.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def relax() -> None:
    """Young collections every `YOUNG_THRESHOLD` net allocations; older ones as CPython's
    defaults space them."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def freeze_startup_heap() -> None:
    """Once started: collect startup's garbage, then exempt what survives from later scans."""
    gc.collect()
    gc.freeze()
