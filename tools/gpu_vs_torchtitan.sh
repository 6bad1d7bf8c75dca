#!/usr/bin/env bash
# flatron against TorchTitan on one GPU, each through its own trainer: Llama-3.2-1B's shape (16 layers,
# h 2048, GQA 32/8, ffn 8192, vocab 128256, rope theta 5e5), seq 4096, 4 sequences a step, synthetic
# tokens, bf16 compute with fp32 master weights, every block compiled, with and without FP8 rowwise:
#   bash tools/gpu_vs_torchtitan.sh     # ~3.5 minutes on an H200; log in $OUT/log (OUT defaults to runs/gpu_vs_torchtitan)
# Cells (CELLS picks some; flatron_amp last, run only while the budget lasts):
#   flatron: train.py, precision.type=mixed_precision (bf16 parameters, fp32 masters), model.compile,
#     tied embeddings as the model has them, precision.fp8=rowwise for the FP8 cells; flatron_amp:
#     precision.type=autocast (fp32 parameters under bf16 autocast, as TorchTitan on one GPU);
#   TorchTitan: its own train.main with a `1B` llama3 flavor registered beside its llama3 spec, synthetic
#     tokens in place of a dataset; on one GPU it trains fp32 parameters under bf16 autocast (AMP; FSDP's
#     bf16-parameter policy needs dp_shard > 1), compile on model and loss, no activation checkpointing,
#     `quantize.linear.float8` with recipe rowwise and the head left in bf16 (as flatron leaves it).
# Each cell: 20 steps, logged every 5; tokens/s over steps 11-15 (the last logged window, which flatron
# reads after its loop, left out on both sides). MFU for both by one convention,
# 6 N + 12 L x heads x head_dim x s FLOPs a token (N: the parameters less the input embedding, the head counted once;
# attention non-causal: what both trainers log), against the datasheet's bf16 dense peak (H100 / H200
# SXM: 989 TFLOP/s, the figure both use). Needs torch with CUDA and the wheels torchtitan 0.2.2,
# torchao, torchdata, tyro, docstring-parser, typeguard, ml-collections in .whl/ (installed to /tmp/site first: a
# machine with no registry); `datasets` is stood in for when absent (no dataset is read).
# The wheels, fetched where pip reaches PyPI (Python 3.12, x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl torchtitan==0.2.2 torchao==0.17.0 torchdata==0.11.0 tyro \
#     docstring-parser typeguard ml-collections
set -u
OUT=${OUT:-runs/gpu_vs_torchtitan}
mkdir -p "$OUT"
LOG="$OUT/log"
CELLS=${CELLS:-flatron_bf16 titan_bf16 flatron_fp8 titan_fp8 flatron_amp}
BUDGET=${BUDGET:-450}          # seconds for everything; a stage gets at most what is left
STEPS=20 LOG_EVERY=5 TIMED_AFTER=10 BATCH=4 SEQ=4096
RUNS=/tmp/gpu_vs_torchtitan
rm -rf "$RUNS"; mkdir -p "$RUNS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi

stage() {   # stage CAP_SECONDS FILE command...: under min(CAP, what is left of BUDGET); output to the log and FILE
  local cap=$1 save=$2; shift 2
  local left=$((BUDGET - SECONDS)); local limit=$((cap < left ? cap : left))
  if ((limit < 30)); then echo "=== skipped, ${left} s left: $*" | tee -a "$LOG"; return 1; fi
  echo "=== $(date +%T) (${limit} s) $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v ' DEBUG ' | tee -a "$LOG" "$save" \
    | grep --line-buffered -E 'step:? +[0-9]+|rror|Traceback|params |FLOPs|versions|Float8|memory usage|done:'
  local rc=${PIPESTATUS[0]}
  echo "=== exit $rc after $SECONDS s" | tee -a "$LOG"
  return "$rc"
}

cat > "$RUNS/titan_bench.py" <<'EOF'
"""TorchTitan's own trainer on Llama-3.2-1B's shape and synthetic tokens, one process, no network.
The spec `llama3_bench`: torchtitan's llama3 (model, parallelize, optimizer, loss) with a `1B` flavor
(its head a matrix of its own: torchtitan's llama3 ties none), no tokenizer, uniform random tokens."""
import dataclasses, importlib.util, os, sys, types
import torch
for key, value in (('RANK', '0'), ('LOCAL_RANK', '0'), ('WORLD_SIZE', '1'), ('LOCAL_WORLD_SIZE', '1'),
                   ('MASTER_ADDR', '127.0.0.1'), ('MASTER_PORT', '29531')):
  os.environ.setdefault(key, value)
if importlib.util.find_spec('datasets') is None or os.environ.get('TITAN_STUB_DATASETS'):
  stub = types.ModuleType('datasets')        # imported by torchtitan's text datasets; none is read
  stub.Dataset = stub.load_dataset = None
  stub.distributed = types.ModuleType('datasets.distributed')
  stub.distributed.split_dataset_by_node = None
  sys.modules['datasets'], sys.modules['datasets.distributed'] = stub, stub.distributed
from torchtitan import train
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models import llama3
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec
FLAVORS = {'1B': TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                      ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000),
           'tiny': TransformerModelArgs(dim=256, n_layers=2, n_heads=16, n_kv_heads=8, vocab_size=2048,
                                        rope_theta=500000)}

class SyntheticLoader(BaseDataLoader):
  def __init__(self, job_config, vocab_size, dp_rank):
    self.batch, self.seq = job_config.training.local_batch_size, job_config.training.seq_len
    self.vocab, self.generator = vocab_size, torch.Generator().manual_seed(1234 + dp_rank)
  def __iter__(self):
    while True:
      tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.generator)
      yield {'input': tokens[:, :-1]}, tokens[:, 1:]
  def state_dict(self):
    return {}
  def load_state_dict(self, state_dict):
    pass

def build_loader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
  return SyntheticLoader(job_config, FLAVORS[job_config.model.flavor].vocab_size, dp_rank)

register_train_spec('llama3_bench', dataclasses.replace(
    llama3.get_train_spec(), model_args=FLAVORS, build_tokenizer_fn=None, build_dataloader_fn=build_loader,
    build_validator_fn=None, state_dict_adapter=None))
if __name__ == '__main__':
  train.main(train.Trainer)
EOF

{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__)'
} 2>&1 | tee -a "$LOG"
TITAN=1
stage 60 /dev/null python3 -c "
import runpy, torch, torchao, torchtitan
runpy.run_path('$RUNS/titan_bench.py', run_name='check')
print('versions: torch', torch.__version__, '| torchtitan', torchtitan.__version__, '| torchao', torchao.__version__)" \
  || TITAN=0

FLATRON="python3 train.py --config=configs/llama3_8b.py --config.device=cuda
  --config.model.num_layers=16 --config.model.hidden_size=2048 --config.model.ffn_hidden_size=8192
  --config.model.num_attention_heads=32 --config.model.num_kv_heads=8 --config.model.share_embeddings_and_output_weights=True
  --config.model.max_position_embeddings=$SEQ --config.data.seq_length=$SEQ --config.data.micro_batch_size=$BATCH
  --config.data.global_batch_size=$BATCH --config.precision.type=mixed_precision --config.model.compile=True
  --config.trainer.max_steps=$STEPS --config.trainer.log_every_n_steps=$LOG_EVERY --config.trainer.val_check_interval=0
  --config.model.optim.sched.warmup_steps=10 --config.exp_manager.log_parameter_norm=False
  --config.exp_manager.create_tensorboard_logger=False"
TT="python3 $RUNS/titan_bench.py --model.name llama3_bench --model.flavor 1B --training.local_batch_size $BATCH
  --training.seq_len $SEQ --training.steps $STEPS --training.mixed_precision_param bfloat16 --compile.enable
  --activation_checkpoint.mode none --lr_scheduler.warmup_steps 10 --metrics.log_freq $LOG_EVERY
  --metrics.disable_color_printing --job.dump_folder $RUNS/titan_out"
TT_FP8="--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name rowwise
  --quantize.linear.float8.filter_fqns output"

for cell in $CELLS; do
  S=$RUNS/$cell.out
  case $cell in
    flatron_bf16) stage 140 $S $FLATRON --workdir=$RUNS/$cell ;;
    flatron_fp8)  stage 140 $S $FLATRON --config.precision.fp8=rowwise --workdir=$RUNS/$cell ;;
    flatron_amp)  stage 140 $S $FLATRON --config.precision.type=autocast --workdir=$RUNS/$cell ;;
    titan_bf16)   ((TITAN)) && stage 140 $S $TT ;;
    titan_fp8)    ((TITAN)) && stage 140 $S $TT $TT_FP8 ;;
  esac
  [ -f "$RUNS/$cell/metrics.jsonl" ] && cp "$RUNS/$cell/metrics.jsonl" "$OUT/$cell.jsonl"
done

python3 - "$RUNS" "$BATCH" "$SEQ" "$TIMED_AFTER" "$STEPS" $CELLS <<'EOF' 2>&1 | tee "$OUT/table.txt" | tee -a "$LOG"
import json, os, re, sys
runs, batch, seq, after, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cells = sys.argv[6:]
L, h, f, heads, kv, V = 16, 2048, 8192, 32, 8, 128256
d = h // heads
block = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f + 2 * h
n = L * block + h + V * h                       # less the input embedding; the head once
flops = 6 * n + 12 * L * heads * d * seq        # FLOPs a token, both trainers' convention (no sliding layers)
PEAK = 989e12                                   # H100 / H200 SXM datasheet, bf16 dense
print(f'N (non-embedding, head once) {n:,} | {flops:.4e} FLOPs/token | peak {PEAK:.3e} FLOP/s | '
      f'{batch} x {seq} tokens a step, steps after {after} and before {last} timed')
print('| cell | tokens/s | MFU | the trainer\'s own MFU | timed steps | peak memory (flatron allocated, TorchTitan reserved) |')
print('|---|---|---|---|---|---|')
for cell in cells:
  tps = own = mem = None; timed = 0
  out = open(os.path.join(runs, cell + '.out'), errors='replace').read() if os.path.exists(
      os.path.join(runs, cell + '.out')) else ''
  if cell.startswith('flatron'):
    path = os.path.join(runs, cell, 'metrics.jsonl')
    recs = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    recs = [r for r in recs if 'step_time' in r and after < r['step'] < last]
    if recs:   # each record: the mean step time of the steps since the last
      tps = batch * seq / (sum(r['step_time'] for r in recs) / len(recs))
      own, timed = sum(r['mfu'] for r in recs) / len(recs), recs[-1]['step'] - after
    m = re.findall(r'peak allocated, against the start-up estimate: rank 0: ([\d,]+) MiB', out)
    mem = float(m[-1].replace(',', '')) / 1024 if m else None
  else:
    rows = [(int(s), float(t.replace(',', '')), float(u), float(g)) for s, g, t, u in re.findall(
        r'step: +(\d+) .*?memory: +([\d.]+)GiB.*?tps: +([\d,]+) .*?mfu: +([\d.]+)%', out)]
    rows = [r for r in rows if after < r[0] < last]
    if rows:   # equal tokens per logged window: the harmonic mean
      tps = len(rows) / sum(1 / r[1] for r in rows)
      own, timed, mem = sum(r[2] for r in rows) / len(rows) / 100, rows[-1][0] - after, max(r[3] for r in rows)
  cols = [f'{tps:,.0f}', f'{100 * tps * flops / PEAK:.1f}%', f'{100 * own:.1f}%', str(timed),
          f'{mem:.1f} GiB' if mem else ''] if tps else ['failed', '', '', '', '']
  print(f'| {cell} | ' + ' | '.join(cols) + ' |')
EOF
