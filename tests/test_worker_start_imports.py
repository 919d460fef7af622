"""What the processes that start a run import before the workers start (docs/performance.md, start-up).

The driver creates the workers as soon as it has joined Ray (``vlmrl.launch``), and a resumed run's Runner from
the thread that starts them while its main thread imports the step loop. So the worker class
(``vlmrl.workers.hybrid``) and the group (``vlmrl.workers.group``) must not import transformers (whose lazy imports
are not safe from two threads, and which takes seconds), vLLM or FSDP at import time: their roles' modules are
imported in the worker's own process, where they are used.

Before that, checking the config (what ``--dry-run`` and every run do first) imports no vision processor,
torchvision, vLLM, datasets or aiohttp either, and no run without LoRA imports peft.
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
    heavy = ("transformers", "vllm", "torchvision", "scipy", "torch.distributed.fsdp")
    assert heavy_imports(imports, heavy) == []


def test_checking_a_config_imports_no_vision_processor_torchvision_or_vllm():
    # transformers' Qwen2-VL image processor pulls in torchvision and torch._dynamo: seconds that every run and
    # every --dry-run would pay before its config is even checked (docs/performance.md, start-up). The families
    # import it where an image is first resized.
    # datasets (through the data loader's module) and aiohttp (through the agent endpoint's) are seconds more.
    heavy = (
        "torchvision", "torch._dynamo", "transformers.models.qwen2_vl.image_processing_qwen2_vl", "vllm", "datasets",
        "aiohttp",
    )  # fmt: skip
    assert heavy_imports("import vlmrl.launch, vlmrl.validate", heavy) == []


def test_the_step_loop_and_the_trainer_import_no_peft_without_lora():
    # peft and the transformers auto classes it imports: seconds in the Runner and in every worker.
    assert heavy_imports("import vlmrl.driver.loop, vlmrl.workers.trainer", ("peft",)) == []
