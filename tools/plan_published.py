"""Published training throughputs and the step-time model's prediction for each, with the
layout the run used and the one tools/plan.py would pick (docs/planning.md's table;
tests/test_plan.py pins the predictions).

    python -m tools.plan_published            # the table, with the planner's pick per row (~s)

Sources (each row's `source`): NxD Training's trn1 figures (Neuron docs, "Trn1/Trn1n Training
Performance", NxD Training 2.26 rows) with the layouts of tests/fixtures/nxd_yaml/2.26;
torchtitan docs/performance.md (Table 1: Llama 3.1 8B, 8 H100, FSDP, local batch 2, selective
AC, seq 8192; the hosts are Grand Teton: H100 96 GB HBM2e at 2.4 TB/s, 500 W); Narayanan et al.
2021 (arXiv 2104.04473) Table 1 / Megatron-LM's README, GPT on DGX A100 80 GB, seq 2048, vocab
51,200, full recompute, teraFLOP/s per GPU counted as 96 B s l h^2 (1 + s/6h + V/16lh) per step.
"""
import dataclasses
import os

from absl import app

from configs import gpt_345m, llama3_70b, llama3_8b, nxd_yaml
from estimates import clusters, step_time
import tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NXD = os.path.join(ROOT, 'tests', 'fixtures', 'nxd_yaml', '2.26')


def _nxd(module, yaml_name):
  """The model of `module` with the layout, batch, recompute and precision of NxD's YAML."""
  c = module.get_config()
  mapped = nxd_yaml.load(os.path.join(NXD, yaml_name)).config
  for key in ('distributed_strategy', 'data', 'precision'):
    c[key] = mapped[key]
  c.bucket_size_collectives = mapped.bucket_size_collectives
  for key in ('activations_checkpoint_granularity', 'activations_checkpoint_recompute'):
    c.model[key] = mapped.model[key]
  c.data.seq_length = 8192
  c.device = 'xla'
  return c


def _torchtitan():
  """torchtitan's selective *op* AC saves SDPA and every other matmul's output, recomputing the
  rest (q, v, gate, down: ~63% of a layer's linear FLOPs): nearest here is recomputing the
  MLP (81%) and not attention; flatron has no per-op policy."""
  c = llama3_8b.get_config()
  c.precision.type, c.device = 'mixed_precision', 'cuda'
  c.data.micro_batch_size, c.data.global_batch_size = 2, 16
  c.model.activations_checkpoint_granularity = 'selective'
  c.model.activations_checkpoint_recompute = ('mlp',)
  c.distributed_strategy.zero1, c.distributed_strategy.zero_stage = True, 3     # FSDP2, reshard_after_forward
  return c


def _torchtitan_float8():
  """The same with torchao's Float8 linears, tensorwise dynamic scaling (their compiled run)."""
  c = _torchtitan()
  c.precision.fp8 = 'tensorwise'
  return c


def _megatron(heads, hidden, layers, tp, pp, gbs):
  c = gpt_345m.get_config()
  m = c.model
  m.num_attention_heads, m.hidden_size, m.num_layers, m.ffn_hidden_size = heads, hidden, layers, 4 * hidden
  m.vocab_size, m.max_position_embeddings, m.activations_checkpoint_granularity = 51200, 2048, 'full'
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 2048, 1, gbs
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.sequence_parallel = tp, pp, False
  c.precision.type, c.device = 'mixed_precision', 'cuda'
  return c


def megatron_tflops(config, step_s, gpus):
  """Narayanan et al.'s teraFLOP/s per GPU (with full recompute: 4 passes)."""
  m, a = config.model, config.data
  b, s, l, h, v = a.global_batch_size, a.seq_length, m.num_layers, m.hidden_size, m.vocab_size
  return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)) / step_s / gpus / 1e12


# The torchtitan hosts: H100 SXM at a 500 W cap (of 700 W) with 96 GB HBM2e (2.4 TB/s), 400 Gb/s
# per GPU. The cap lowers the sustained tensor-core clock: we assume 0.8 x the datasheet peak
# (an assumption, not a measurement: NVIDIA publishes no capped figure).
_H100 = clusters.CLUSTERS['h100']
GRAND_TETON = dataclasses.replace(_H100, name='h100 (Grand Teton: 500 W, HBM2e)', mem_bw=2.4e12, memory_bytes=96e9,
                                  peak={k: 0.8 * v for k, v in _H100.peak.items()})


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  build: object            # () -> config with the published layout
  cluster: object
  devices: int
  published: float
  unit: str                # 'seq/s' | 'tokens/s/GPU' | 'TFLOP/s/GPU'
  source: str


ROWS = (
    Row('Llama-3.1-8B, NxD, 32 x trn1.32xlarge', lambda: _nxd(llama3_8b, 'hf_llama3.1_8B_config.yaml'),
        clusters.CLUSTERS['trn1.32xlarge'], 1024, 47.95, 'seq/s', 'Neuron docs, trn1 training performance (NxD Training)'),
    Row('Llama-3.1-70B, NxD, 32 x trn1.32xlarge', lambda: _nxd(llama3_70b, 'hf_llama3.1_70B_config.yaml'),
        clusters.CLUSTERS['trn1.32xlarge'], 1024, 7.94, 'seq/s', 'Neuron docs, trn1 training performance (NxD Training)'),
    Row('Llama-3.1-8B, torchtitan FSDP, 8 x H100', _torchtitan, GRAND_TETON, 8, 5762, 'tokens/s/GPU',
        'torchtitan docs/performance.md, Table 1'),
    Row('Llama-3.1-8B, torchtitan FSDP + Float8, 8 x H100', _torchtitan_float8, GRAND_TETON, 8, 8532,
        'tokens/s/GPU', 'torchtitan docs/performance.md, Table 1 (compiled + Float8 tensorwise)'),
    Row('GPT 18.4B, Megatron-LM, 256 x A100 (t8 p1)', lambda: _megatron(48, 6144, 40, 8, 1, 1024),
        clusters.CLUSTERS['a100'], 256, 135, 'TFLOP/s/GPU', 'Narayanan et al. 2021, Table 1'),
    Row('GPT 145.6B, Megatron-LM, 1536 x A100 (t8 p8)', lambda: _megatron(96, 12288, 80, 8, 8, 2304),
        clusters.CLUSTERS['a100'], 1536, 148, 'TFLOP/s/GPU', 'Narayanan et al. 2021, Table 1'),
)


def predicted(row, config=None, prediction=None) -> float:
  """The row's figure in its unit, from the model."""
  config = config or row.build()
  p = prediction or step_time.predict(config, row.cluster, row.devices)
  if row.unit == 'seq/s':
    return config.data.global_batch_size / p.step_s
  if row.unit == 'tokens/s/GPU':
    return p.tokens_per_s / row.devices
  return megatron_tflops(config, p.step_s, row.devices)


def table(with_pick=True) -> list:
  """[(row, prediction, the figure predicted, the planner's best layout or '')]."""
  from tools import plan   # pylint: disable=import-outside-toplevel  (plan imports nothing of this)
  out = []
  for row in ROWS:
    config = row.build()
    p = step_time.predict(config, row.cluster, row.devices)
    pick = ''
    if with_pick:
      best = plan.search(config, row.cluster, row.devices).ranked[:1]
      pick = (f'{best[0].layout.describe()}: {best[0].prediction.tokens_per_s / p.tokens_per_s:.2f}x the tokens/s'
              if best else 'none fits')
    out.append((row, p, predicted(row, config, p), pick))
  return out


def define_flags():
  """No flags: the table is fixed (ROWS)."""


def main(argv):
  tools.no_arguments(argv)
  print('| run | published | predicted | error | MFU | bubble | comm | largest terms (s/step) | planner\'s pick |')
  print('|---|---|---|---|---|---|---|---|---|')
  for row, p, value, pick in table():
    big = sorted(((k, v) for k, v in p.terms.items() if v), key=lambda kv: -kv[1])[:3]
    print(f'| {row.name} | {row.published:,} {row.unit} | {value:,.4g} | {value / row.published - 1:+.1%} | {p.mfu:.1%} | '
          f'{p.bubble:.1%} | {p.comm:.1%} | {", ".join(f"{k} {v:.3g}" for k, v in big)} | {pick} |')


if __name__ == '__main__':
  define_flags()
  app.run(main)
