"""The multi-device snippets of README.md and docs/ run on 8 devices and update as one device does.

test_readme.py and test_docs.py run every snippet in the suite's process, which has
one CPU device: there a step that scales its gradients by the device count looks
right. Here the snippets that build a mesh over all of ``jax.devices()`` run again in a
subprocess with 8 CPU devices (this file as a script), after the blocks they build
on: in README.md the blocks before them, in a docs page its first block (the
imports). Each such snippet that trains compares its update with the one-device
update of the whole batch (``one_device``); the test checks that it does and that
it ran on 8 devices.
"""

import re
import sys
from pathlib import Path

from tests.helpers import run_with_devices

ROOT = Path(__file__).resolve().parents[2]
N_DEVICES = 8


def _is_multi_device(block: str) -> bool:
    # A mesh over all devices: len(jax.devices()) or np.array(jax.devices()).
    return bool(re.search(r"(len|array)\(jax\.devices\(\)\)", block))


def _runs() -> dict[str, list[tuple[str, str]]]:
    """file -> the (label, code) blocks to run for it, in order."""
    from tests.smoke.test_docs import PAGES, python_blocks
    from tests.smoke.test_readme import BLOCKS

    runs = {}
    last = max((i for i, (_, b) in enumerate(BLOCKS) if _is_multi_device(b)), default=-1)
    if last >= 0:
        runs["README.md"] = [(f"README.md:{line}", code) for line, code in BLOCKS[: last + 1]]
    for page in PAGES:
        blocks = python_blocks(page.read_text())
        rel = str(page.relative_to(ROOT))
        chosen = [(f"{rel} block {i + 1}", b) for i, b in enumerate(blocks) if _is_multi_device(b)]
        if chosen:
            first = [(f"{rel} block 1", blocks[0])] if not _is_multi_device(blocks[0]) else []
            runs[rel] = first + chosen
    return runs


def _worker() -> dict:
    import os
    import tempfile

    import jax

    os.chdir(tempfile.mkdtemp())  # snippets that write files write them here
    ran = {}
    for name, blocks in _runs().items():
        namespace = {"__name__": "snippets_" + re.sub(r"\W", "_", name)}
        with jax.numpy_dtype_promotion("standard"):
            for label, code in blocks:
                exec(compile(code, label, "exec"), namespace)
        ran[name] = [label for label, _ in blocks]
    return {"devices": len(jax.devices()), "ran": ran}


def test_multi_device_snippets_update_as_one_device_does():
    runs = _runs()
    # The pages that teach many devices are found (guards the selection itself).
    assert {"README.md", "docs/troubleshooting.md"} <= runs.keys()
    for blocks in runs.values():
        for label, code in blocks:
            if _is_multi_device(code) and "loss_scaling" in code:
                assert "one_device" in code, f"{label} trains without checking the update size"
    out = run_with_devices(__file__, N_DEVICES, timeout=600)
    assert out["devices"] == N_DEVICES
    assert out["ran"] == {name: [label for label, _ in blocks] for name, blocks in runs.items()}


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(ROOT))
    print(json.dumps(_worker()))
