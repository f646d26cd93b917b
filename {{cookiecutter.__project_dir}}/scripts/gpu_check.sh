#!/usr/bin/env bash
# One-shot check of the paths that need GPUs (CI runs on CPUs only):
# CUDA bf16 and fp16 (grad scaler), deterministic mode, and with 2+ GPUs
# NCCL DDP (self-launched and torchrun) and FSDP through accelerate's own
# GPU code path, with bf16 as FSDP's mixed-precision policy.
#
#   pip install -e '.[dev]' && bash scripts/gpu_check.sh
#
# Every run trains the example task for a few epochs and must reach 90 %
# validation accuracy; the script prints one line per check and exits
# non-zero if any failed. Run dirs land in runs/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
  echo "no CUDA GPU visible: nothing to check here" >&2
  exit 2
fi
echo "GPUs: $GPUS ($(python -c "import torch; print(torch.cuda.get_device_name(0))"))"

OUT=runs/gpu_check
rm -rf "$OUT"
FAILED=0
COMMON=(trainer.max_epochs=8 tracker=csv)

check() {  # check NAME WORLD_SIZE EXPECTED_TYPE -- command...
  local name=$1 world=$2 kind=$3
  shift 4
  local dir="$OUT/$name"
  local start=$SECONDS
  if "$@" "${COMMON[@]}" "hydra.run.dir=$dir" >"$OUT-$name.log" 2>&1 &&
     python - "$dir" "$world" "$kind" <<'PY'
import json, sys
from pathlib import Path
run_dir, world, kind = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
summary = json.loads((run_dir / "summary.json").read_text())
assert summary["world_size"] == world, summary["world_size"]
assert summary["metrics"]["val/acc"] >= 0.90, summary["metrics"]["val/acc"]
assert f"({kind})" in (run_dir / "train.log").read_text(), f"not {kind}"
PY
  then
    echo "PASS  $name ($((SECONDS - start)) s)"
  else
    echo "FAIL  $name: see $OUT-$name.log and $dir/"
    FAILED=1
  fi
}

mkdir -p "$OUT"
check cuda_fp32 1 NO -- python train.py
check cuda_bf16 1 NO -- python train.py trainer.mixed_precision=bf16
check cuda_fp16 1 NO -- python train.py trainer.mixed_precision=fp16
check deterministic 1 NO -- python train.py seeding=deterministic
if [ "$GPUS" -ge 2 ]; then
  check ddp_nccl_bf16 2 MULTI_GPU -- python train.py parallel=ddp parallel.num_processes=2 \
    trainer.mixed_precision=bf16
  check torchrun_ddp 2 MULTI_GPU -- torchrun --standalone --nproc_per_node 2 train.py parallel=ddp
  check fsdp_bf16 2 FSDP -- python train.py parallel=fsdp parallel.num_processes=2 \
    parallel.auto_wrap_min_params=1000 trainer.mixed_precision=bf16
else
  echo "SKIP  ddp/fsdp: need 2 GPUs"
fi
exit $FAILED
