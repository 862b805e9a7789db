"""The README's example runs as its launch line says (2 gloo ranks under torchrun, CUDA hidden), and
the README shows that file as it is."""
import os
import re

from .programs import ROOT, run

EXAMPLE = os.path.join("examples", "dispatch_combine.py")


def test_readme_shows_the_example_file():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, EXAMPLE)) as f:
        code = f.read().split("\n", 1)[1]  # the file less its docstring line, which the README's prose says
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks and blocks[0] == code
    first_screen = readme[:readme.index("## ")]
    assert f"torchrun --nproc-per-node 2 {EXAMPLE}" in first_screen and "bf16_below_bytes" in first_screen
    assert 20 <= len(code.splitlines()) <= 30


def test_example_runs_on_two_cpu_ranks():
    done = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE, timeout=300,
               env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for rank in (0, 1):  # past the threshold: FP8 rows on both ranks, and a gradient back to x
        assert re.search(rf"rank {rank}: \d+ rows of torch.float8_e4m3fn in, y \(512, 1024\), \|x.grad\| \d",
                         done.stdout), done.stdout  # (the ranks' lines may interleave)
