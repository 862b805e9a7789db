"""Run a Megatron training script with fp8a2a registered:

    python -m fp8a2a.megatron.run SCRIPT.py ARGS...
    torchrun --nproc-per-node 8 -m fp8a2a.megatron.run pretrain_gpt.py --moe-token-dispatcher-type fp8_alltoall ...

Puts the script's directory first on sys.path (as `python SCRIPT.py` does, so a Megatron-LM
checkout's own `megatron` package is found from anywhere), calls fp8a2a.megatron.register() (the
dispatcher type and the --fp8a2a-* flags, before the script's parse_args) and runs the script as
`__main__` with sys.argv = [SCRIPT.py, ARGS...]. Exit status 2 with one line on stderr when no
script is given or it is not a file.

Megatron's initialize runs `make` in megatron/core/datasets (compile_helpers) and exits when that
fails. The megatron-core wheel ships that helper built but no Makefile, so there the step can only
fail: where the built helper imports and no Makefile sits beside it, the launcher skips the step."""
import importlib.util
import os
import runpy
import sys

USAGE = "usage: python -m fp8a2a.megatron.run SCRIPT.py [ARGS...]"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(f"{USAGE}: no script given", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__)
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"fp8a2a.megatron.run: no such script: {script}", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    from . import register
    register()
    if skip_prebuilt_dataset_helper() and os.environ.get("RANK", "0") == "0":
        print("fp8a2a.megatron.run: megatron.core's dataset helper is prebuilt (no Makefile beside it): "
              "skipping Megatron's compile step", file=sys.stderr)
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")
    return 0


def skip_prebuilt_dataset_helper() -> bool:
    """Make megatron.core.datasets.utils.compile_helpers a no-op where the helper is built and cannot
    be rebuilt (the wheel's layout); True if it did. A checkout with its Makefile keeps the step."""
    try:
        spec = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    if spec is None or not spec.origin or os.path.exists(os.path.join(os.path.dirname(spec.origin), "Makefile")):
        return False
    from megatron.core.datasets import utils
    utils.compile_helpers = lambda: None
    return True


if __name__ == "__main__":
    sys.exit(main())
