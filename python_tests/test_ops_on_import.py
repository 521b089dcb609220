"""Issue 40 item 11: after `import rlkernels`, `torch.ops.rlkernels.<op>` raised AttributeError until some rlkernels
function had run, so a graph exported or compiled elsewhere could not find its ops. Each order of the two imports
runs in a fresh interpreter; the ops found are then called and compared with log_softmax."""
import subprocess
import sys

import pytest

CHECK = """
import torch.nn.functional as F
logits, targets = torch.randn(4, 11, dtype=torch.float64), torch.randint(0, 11, (4,))
want = F.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
ops = [torch.ops.rlkernels.token_logprobs_fwd_torch]
if rlkernels.backend_info()["cpu"]["available"]:
    ops.append(torch.ops.rlkernels_C.token_logprobs_fwd)
for op in ops:
    logp, entropy, _ = op(logits, targets, 1.0, 0.0, True)
    assert torch.allclose(logp, want), op
print(len(ops), sorted(m for m in ("rlkernels.ops",) if m in sys.modules))
"""


@pytest.mark.parametrize("imports", ["import rlkernels, torch", "import torch, rlkernels",
                                     "import rlkernels; import torch.nn", "from rlkernels import presets; import rlkernels"])
def test_ops_exist_after_both_imports_in_either_order(imports):
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", f"import sys\n{imports}\nimport torch\n{CHECK}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "['rlkernels.ops']", out.stdout


def test_the_package_alone_still_imports_no_torch():
    """The command line's `--help` stays fast: `import rlkernels` without torch imports neither torch nor the ops."""
    out = subprocess.run([sys.executable, "-c", "import sys, rlkernels; print(sorted(m for m in sys.modules "
                          "if m == 'torch' or m.startswith('rlkernels.')))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
