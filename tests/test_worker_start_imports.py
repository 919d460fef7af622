"""The Runner creates the workers before it imports the heavy libraries (vlmrl.driver.runner).

It imports the worker class (``vlmrl.workers.hybrid``) and the group (``vlmrl.workers.group``) before it starts
them, from the thread that starts them while the main thread imports the step loop. So those two modules must
not import transformers (whose lazy imports are not safe from two threads, and which takes seconds) or vLLM at
import time: their roles' modules are imported in the worker's own process, where they are used.

Before that, checking the config (what ``--dry-run`` and every run do first) imports no vision processor,
torchvision or vLLM either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def heavy_imports(imports: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of ``heavy`` a fresh interpreter has in sys.modules after running ``imports``."""
    probe = f"import json, sys\n{imports}\nprint(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_worker_class_and_group_import_without_transformers_or_vllm():
    imports = "import vlmrl.workers.group, vlmrl.workers.hybrid\nfrom vlmrl.workers.hybrid import HybridWorker"
    assert heavy_imports(imports, ("transformers", "vllm", "torchvision", "scipy")) == []


def test_checking_a_config_imports_no_vision_processor_torchvision_or_vllm():
    # transformers' Qwen2-VL image processor pulls in torchvision and torch._dynamo: seconds that every run and
    # every --dry-run would pay before its config is even checked (docs/performance.md, start-up). The families
    # import it where an image is first resized.
    heavy = ("torchvision", "torch._dynamo", "transformers.models.qwen2_vl.image_processing_qwen2_vl", "vllm")
    assert heavy_imports("import vlmrl.launch, vlmrl.validate", heavy) == []
