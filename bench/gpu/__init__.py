"""The GPU check: engines, conversion, checkpoints and weight sync on CUDA with NCCL.

One command on a machine with NVIDIA GPUs (``tools/gpu_check.sh OUT`` or
``python -m bench.gpu --out OUT``): it installs what is missing from local wheels,
prints the versions, launches the checks under ``torchrun`` (world size 1 on NCCL;
the two-process weight sync on two or more GPUs) within a time budget, and writes
every figure as a table to stdout and as JSON to ``OUT/report.json``.

Modules: :mod:`.args` (the command line), :mod:`.wheels` (the install plan and the
commands that prepare the wheels), :mod:`.plan` (the checks and their budgets),
:mod:`.report` (records, the table, the JSON file), :mod:`.compare` (pure figures),
:mod:`.versions`, the checks (:mod:`.engines`, :mod:`.megatron_native`,
:mod:`.transfer`), :mod:`.worker` (the torchrun entry) and :mod:`.driver`.
"""
