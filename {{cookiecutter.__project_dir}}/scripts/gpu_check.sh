#!/usr/bin/env bash
# One-shot check of the paths that need GPUs (CI runs on CPUs only):
# CUDA bf16 and fp16 (grad scaler), deterministic mode, the GPT example with
# bf16 autocast, torch.compile, fused AdamW and async checkpoints (pinned-memory
# staging) reporting tokens/s and MFU; FSDP on one GPU (per-block units, bf16
# params with fp32 reduction; CPU offload with activation checkpointing); and with
# 2+ GPUs NCCL DDP (self-launched and torchrun) and FSDP through accelerate's own
# GPU code path, for the digits task and the GPT (with and without activation
# checkpointing). Exact resume on CUDA: runs stopped with SIGTERM after their first
# checkpoint and rerun must end with the weights of an uninterrupted run, byte for byte
# (digits in deterministic mode, the GPT in bf16, a LoRA fine-tune on chat data, and
# torchvision augmentation with 2 loader workers where torchvision imports).
#
#   pip install -e '.[dev]' && bash scripts/gpu_check.sh
#
# Every digits run trains a few epochs and must reach 90 % validation accuracy;
# every GPT run trains 300 steps and must bring the validation loss below 2.0
# (5.5 at the start) with MFU logged. Every checkpoint must verify. The script
# prints one line per check (with tokens/s and MFU for the GPT) and exits
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
DIGITS="m['val/acc'] >= 0.90"
GPT_OK="m['val/loss'] < 2.0 and m['perf/mfu'] > 0 and m['perf/tokens_per_sec'] > 0"
GPT=(model=gpt data=tokens trainer.mixed_precision=bf16 trainer.compile=true optimizer.fused=true
     trainer.max_steps=300 trainer.eval_every_n_steps=150 checkpoint.async_save=true
     checkpoint.every_n_steps=100)

check() {  # check NAME WORLD_SIZE EXPECTED_TYPE CONDITION -- command...
  local name=$1 world=$2 kind=$3 condition=$4
  shift 5
  local dir="$OUT/$name"
  local start=$SECONDS
  local figures
  if "$@" trainer.max_epochs=8 tracker=csv "hydra.run.dir=$dir" >"$OUT-$name.log" 2>&1 &&
     python -m training_engine.checkpoint verify "$dir" >>"$OUT-$name.log" 2>&1 &&
     figures=$(python - "$dir" "$world" "$kind" "$condition" <<'PY'
import json, sys
from pathlib import Path
run_dir, world, kind, condition = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
summary = json.loads((run_dir / "summary.json").read_text())
m = summary["metrics"]
assert summary["world_size"] == world, summary["world_size"]
assert eval(condition, {"m": m}), f"{condition}: {m}"
assert f"({kind})" in (run_dir / "train.log").read_text(), f"not {kind}"
shown = ("val/acc", "val/loss", "perf/tokens_per_sec", "perf/mfu")
print(" ".join(f"{k}={m[k]:.4g}" for k in shown if k in m))
PY
)
  then
    echo "PASS  $name ($((SECONDS - start)) s) $figures"
  else
    echo "FAIL  $name: see $OUT-$name.log and $dir/"
    FAILED=1
  fi
}

# resume_check NAME -- ARGS...: the run whole, then the same run stopped with SIGTERM
# once its first checkpoint is committed and rerun; both final weights must be equal.
resume_check() {
  local name=$1 start=$SECONDS
  shift 2
  local whole="$OUT/resume_$name-whole" cut="$OUT/resume_$name-cut" log="$OUT-resume_$name.log"
  python train.py "$@" tracker=csv "hydra.run.dir=$whole" >"$log" 2>&1
  python train.py "$@" tracker=csv "hydra.run.dir=$cut" >>"$log" 2>&1 &
  local pid=$!
  until ls -d "$cut"/checkpoints/step_* >/dev/null 2>&1 || ! kill -0 $pid 2>/dev/null; do
    sleep 0.1
  done
  kill -TERM $pid 2>/dev/null
  wait $pid
  local stopped=$? at
  at=$(ls "$cut/checkpoints" | grep step_ | tail -1)
  python train.py "$@" tracker=csv "hydra.run.dir=$cut" >>"$log" 2>&1
  if [ "$stopped" -eq 143 ] && [ -s "$whole/model.safetensors" ] &&
     cmp -s "$whole/model.safetensors" "$cut/model.safetensors" &&
     python -m training_engine.checkpoint verify "$cut" >>"$log" 2>&1; then
    echo "PASS  resume_$name ($((SECONDS - start)) s) stopped at $at, final weights identical"
  else
    echo "FAIL  resume_$name (stop exit $stopped): see $log"
    FAILED=1
  fi
}

mkdir -p "$OUT"
check cuda_fp32 1 NO "$DIGITS" -- python train.py
check cuda_bf16 1 NO "$DIGITS" -- python train.py trainer.mixed_precision=bf16
check cuda_fp16 1 NO "$DIGITS" -- python train.py trainer.mixed_precision=fp16
check deterministic 1 NO "$DIGITS" -- python train.py seeding=deterministic
check gpt_bf16_compile 1 NO "$GPT_OK" -- python train.py "${GPT[@]}"
# FSDP on one GPU: per-block units with bf16 params / fp32 reduction, then with the
# sharded state in CPU memory (CPU offload) and activation checkpointing.
check gpt_fsdp_one_gpu 1 FSDP "$GPT_OK" -- python train.py "${GPT[@]}" parallel=fsdp \
  parallel.num_processes=1
check gpt_fsdp_offload_ac 1 FSDP "$GPT_OK" -- python train.py "${GPT[@]}" parallel=fsdp \
  parallel.num_processes=1 parallel.cpu_offload=true parallel.activation_checkpointing=true \
  trainer.compile=false
resume_check digits_deterministic -- seeding=deterministic trainer.max_epochs=4
resume_check gpt_bf16 -- model=gpt data=tokens trainer.mixed_precision=bf16 \
  trainer.max_steps=200 trainer.eval_every_n_steps=100 checkpoint.every_n_steps=40
resume_check gpt_lora_bf16 -- model=gpt data=chat model.peft=lora \
  trainer.mixed_precision=bf16 trainer.max_steps=120 checkpoint.every_n_steps=30
if python -c "import torchvision" 2>/dev/null; then
  resume_check torchvision_augment -- data=images model=cnn data.num_workers=2 \
    'data.augment=[{_target_:torchvision.transforms.v2.RandomAffine,degrees:10.0,translate:[0.1,0.1]},{_target_:torchvision.transforms.v2.RandomCrop,size:[8,8],padding:1}]' \
    trainer.max_epochs=3 checkpoint.every_n_steps=10
else
  echo "SKIP  resume_torchvision_augment: torchvision does not import"
fi
if [ "$GPUS" -ge 2 ]; then
  check ddp_nccl_bf16 2 MULTI_GPU "$DIGITS" -- python train.py parallel=ddp \
    parallel.num_processes=2 trainer.mixed_precision=bf16
  check torchrun_ddp 2 MULTI_GPU "$DIGITS" -- torchrun --standalone --nproc_per_node 2 \
    train.py parallel=ddp
  check fsdp_bf16 2 FSDP "$DIGITS" -- python train.py parallel=fsdp parallel.num_processes=2 \
    parallel.auto_wrap_min_params=1000 trainer.mixed_precision=bf16
  check gpt_ddp 2 MULTI_GPU "$GPT_OK" -- python train.py "${GPT[@]}" parallel=ddp \
    parallel.num_processes=2
  check gpt_fsdp 2 FSDP "$GPT_OK" -- python train.py "${GPT[@]}" parallel=fsdp \
    parallel.num_processes=2
  check gpt_fsdp_ac 2 FSDP "$GPT_OK" -- python train.py "${GPT[@]}" parallel=fsdp \
    parallel.num_processes=2 parallel.activation_checkpointing=true
else
  echo "SKIP  ddp/fsdp: need 2 GPUs"
fi
exit $FAILED
