#!/usr/bin/env bash
# The CUDA figures of docs/performance.md in one run on a one-GPU machine, most important first, each stage
# under its own time limit so one slow or failing stage leaves the rest:
#   bash tools/gpu_bench.sh            # writes $OUT/gpu_bench.log (OUT defaults to runs/gpu_bench)
# 1. the fused update replayed as one CUDA graph (optim/graphed.py) against launched call by
#    call: 6 bf16SR steps of llama_tiny each way, parameters and moments compared bit for bit;
#    and train.py's bitwise resume through it: 20 steps straight, 10 + a resume to 20, and 20
#    with an async checkpoint saved every step, the losses compared;
# 2. tools/bench_hf.py against transformers: TinyLlama-1.1B's shape (bf16: graph on, with each
#    side's profile and GPU idle time, then graph off) and llama_50m's, eager and compiled per block;
# 3. the loop itself on CUDA (train.py, llama_tiny, bf16SR and mixed_precision, 30 steps each);
# 4. bf16SR's fused update on CUDA: compiled (triton) against eager on sr_update's probe, under
#    the eager-numerics settings and triton's defaults, and its speed on 64M elements.
# Prints the tables again at the end.
# Needs torch with CUDA, transformers, tensorstore, einops, absl-py, ml-collections (wheels in
# .whl/ are installed to /tmp/site first: a machine with no registry).
set -u
OUT=${OUT:-runs/gpu_bench}
mkdir -p "$OUT"
LOG="$OUT/gpu_bench.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
THREADS=$(nproc)

stage() {   # stage SECONDS command...: the command's output (less inductor's DEBUG lines) to the log
  local limit=$1; shift
  echo "=== $(date +%T) $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v ' DEBUG ' | tee -a "$LOG" | grep --line-buffered -E '^\||^model |TFLOP|rror|Traceback|step [0-9]+/|val_loss|MFU peak|measured|bf16SR|probe|GPU busy|==='
  echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$LOG"

stage 120 python3 - <<'EOF'
import torch
from configs import llama_tiny
from data.loader import Loader
from optim import graphed, update
from parallel import mesh as meshes, tensor, training
c = llama_tiny.get_config()
c.device, c.precision.type, c.trainer.gradient_clip_val = 'cuda', 'bf16SR', 1.0
mesh = meshes.init(c)
ops, loader = tensor.make_ops(mesh), Loader(c, 'train', 0, 1)
def train(enabled, steps=6):
  graphed.ENABLED = enabled
  graphed.clear()
  params = training.init_params(c, mesh)
  updater = update.Updater(params, c, mesh)
  losses = [training.train_step(params, updater, loader.global_batch(i * c.data.global_batch_size), c, i, mesh,
                                ops)['loss'].item() for i in range(steps)]
  state = dict(params)
  state.update({f'{k}.{n}': v for n, m in updater.master.items() for k, v in updater.optimizer.state[m].items()
                if torch.is_tensor(v) and v.dim()})
  return losses, state, len(graphed._graphs.graphs), len(updater.fused)
(l0, s0, _, fused), (l1, s1, graphs, _) = train(False), train(True)
differ = sum(int((a.view(torch.int16) != s1[n].view(torch.int16)).sum()) for n, a in s0.items())
print(f'measured: graph replay vs call by call, 6 bf16SR steps of llama_tiny ({fused} fused tensors, '
      f'{graphs} graph held): {differ} of {sum(a.numel() for a in s0.values())} bf16 parameter and moment '
      f'values differ; losses {l0[-1]:.6f} / {l1[-1]:.6f}; equal: {l0 == l1}')
EOF

T="python3 train.py --config=configs/llama_tiny.py --config.device=cuda --config.precision.type=bf16SR
   --config.trainer.max_steps=20 --config.trainer.log_every_n_steps=1 --config.exp_manager.create_checkpoint_callback=True
   --config.exp_manager.resume_if_exists=True --config.exp_manager.resume_ignore_no_checkpoint=True"
R=/tmp/gpu_bench_resume
rm -rf $R
stage 60 $T --workdir=$R/straight
stage 60 $T --workdir=$R/resumed --config.trainer.exit_interval=10
stage 60 $T --workdir=$R/resumed
stage 60 $T --workdir=$R/async --config.exp_manager.async_checkpointing=True \
  --config.exp_manager.checkpoint_callback_params.every_n_train_steps=1
stage 30 python3 -c "
import json
L = lambda w: [json.loads(l)['loss'] for l in open(f'$R/{w}/metrics.jsonl') if '\"loss\"' in l]
s, r, a = L('straight'), L('resumed'), L('async')
print('measured: bf16SR losses over', len(s), 'steps: resumed at 10 == straight:', r == s,
      '| an async checkpoint every step == straight:', a == s)"

B="python3 -m tools.bench_hf --device=cuda --threads=$THREADS"
stage 150 $B --model=tinyllama_1b --precisions=bf16 --steps=5 --warmup=2 --profile
stage 120 $B --model=tinyllama_1b --precisions=bf16 --steps=5 --warmup=2 --nocuda_graph_update
stage 150 $B --model=llama_50m --precisions=bf16 --steps=5 --warmup=2
stage 150 $B --model=llama_50m --precisions=bf16 --steps=5 --warmup=2 --nocuda_graph_update
stage 200 $B --model=tinyllama_1b --precisions=bf16 --steps=5 --warmup=2 --compile
stage 150 $B --model=tinyllama_1b --precisions=mixed --steps=5 --warmup=2
stage 150 $B --model=llama_50m --precisions=bf16,mixed --steps=5 --warmup=2 --compile

for recipe in bf16SR mixed_precision; do
  stage 60 python3 train.py --config=configs/llama_tiny.py --workdir="/tmp/gpu_bench_$recipe" --config.device=cuda \
    --config.precision.type=$recipe --config.trainer.max_steps=30 --config.trainer.log_every_n_steps=10
done

stage 120 python3 - <<'EOF'
import contextlib, time, torch
from optim import sr_update
device = torch.device('cuda')
exact = sr_update._compile_settings
for settings in ('triton defaults', 'eager numerics'):
  torch._dynamo.reset(); sr_update._compiled.cache_clear()
  sr_update._compile_settings = (lambda d: contextlib.nullcontext()) if settings == 'triton defaults' else exact
  for kernel in (sr_update._round_kernel, sr_update._adamw_kernel):
    differ, total = sr_update.differing_bits(kernel, device)
    print(f'probe: {settings}: compiled {kernel.__name__} rounds {differ} of {total} bf16 outputs differently from eager')
args = sr_update._probe(sr_update._adamw_kernel, device)
n = 1 << 26
args = [a.repeat(16) if torch.is_tensor(a) and a.numel() == 1 << 22 else a for a in args]
_, args[6] = sr_update._layout((slice(0, n),), (n,), device)
for name, fn in (('compiled', sr_update._compiled(sr_update._adamw_kernel)), ('eager', sr_update._adamw_kernel)):
  with exact(device):
    fn(*args)
  torch.cuda.synchronize()
  start = time.perf_counter()
  for _ in range(10):
    fn(*args)
  torch.cuda.synchronize()
  ms = (time.perf_counter() - start) / 10 * 1e3
  print(f'probe: bf16SR update of {n:,} elements, {name}: {ms:.2f} ms, {n * 14 / ms / 1e6:.0f} GB/s (bf16 row, gradient, moments read; row, moments written)')
EOF

echo "=== the tables"
grep -E '^\||^model |TFLOP|probe:|measured:|GPU busy' "$LOG"
