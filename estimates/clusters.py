"""The machines the planner (tools/plan.py, estimates/step_time.py) knows: per device its peak
FLOP/s per dtype, memory and memory bandwidth; per node its device count and the intra- and
inter-node links, as alpha (latency, s) and beta (bandwidth per device, bytes/s one way).

A "device" is what runs one rank: a GPU, a NeuronCore (NxD's `devices: 32` per trn1.32xlarge;
on trn2.48xlarge a logical core of 2 physical ones, LNC=2, 64 per node), a TPU chip, or a
process here (`local`, written by `tools/plan.py --calibrate`).
Datasheet figures are peaks; `matmul_eff` is the fraction of the dtype's dense peak a large
training GEMM reaches, `attn_eff` the fraction attention kernels reach, `link_eff` the
fraction of link bandwidth a large ring collective reaches. Those three are judgement, not
datasheet: each says where it comes from.
"""
import dataclasses
import json
import logging
import os

GB, GiB = 1e9, 2**30
CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'flatron', 'local_cluster.json')


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  device: str               # config.device the ranks run ('cuda', 'xla', 'cpu'): the memory model reads it
  devices_per_node: int
  peak: dict                # dtype name ('fp32', 'bf16', 'fp8' where the device has FP8 GEMMs) -> dense FLOP/s
  memory_bytes: float       # per device
  mem_bw: float             # bytes/s per device
  intra_bw: float           # bytes/s per device, one way, inside a node
  intra_lat: float          # s per collective step inside a node
  inter_bw: float           # bytes/s per device, one way, across nodes (the node's NICs / its devices)
  inter_lat: float          # s per step across nodes
  matmul_eff: float = 0.7
  attn_eff: float = 0.5
  link_eff: float = 0.8
  source: str = ''
  # Measured by --calibrate on `local` only (0: the datasheet model, bytes at mem_bw and no
  # overhead; on accelerators the host's work runs ahead of the device's and hides).
  ew_bw: float = 0.0        # bytes/s the code's elementwise passes (norms, RoPE, act x up) reach
  logit_s: float = 0.0      # seconds per logit element of the head's softmax and loss, fwd + bwd
  layer_overhead: float = 0.0       # s of framework work per layer and micro batch (fwd + bwd)
  layer_step_overhead: float = 0.0  # s per layer and step (its parameters' optimizer loop)
  micro_overhead: float = 0.0       # s per micro batch outside the layers (embedding, head, loss)
  step_overhead: float = 0.0        # s per step
  sync_wait: float = 0.0            # s a blocking TP collective waits for the other ranks beyond
                                    # its back-to-back time (they arrive after jittering compute)
  # {collective: [[n bytes, seconds], ...]} measured between 2 ranks of a node (n as
  # estimates/step_time.py's formula for it reads it): gloo's all-reduce and p2p differ ~10x in
  # latency here, and no one alpha-beta line fits its all-reduce; None: the figures above
  op_times: dict = None


CLUSTERS = {
    # Neuron docs, "Trainium Architecture" and "Trn1/Trn1n Architecture": 16 chips of 2
    # NeuronCore-v2; per chip 190 BF16 (and cFP8: no faster) / 47.5 FP32 TFLOPS, 32 GiB at 820 GiB/s; 800 Gbps EFA per
    # instance. One rank per NeuronCore (NxD: devices 32), so halve the per-chip figures.
    # NeuronLink-v2 bandwidth is not in the docs: 4 links per chip; we assume ~96 GB/s per core
    # one way (AWS's 768 GB/s per chip at launch, shared by its 2 cores and both directions).
    # matmul_eff 0.55: NxD's public MFU on trn1 (~25-40%) with our collective terms; judgement.
    'trn1.32xlarge': Cluster('trn1.32xlarge', 'xla', 32, {'bf16': 95e12, 'fp32': 23.75e12, 'fp8': 95e12}, 16 * GiB,
                             410 * GiB, 96 * GB, 10e-6, 100 * GB / 32, 30e-6, matmul_eff=0.55, attn_eff=0.35,
                             source='Neuron docs trainium.html / trn1-arch (datasheet); NeuronLink bandwidth assumed'),
    # Neuron docs, "Trainium2 Architecture": 16 chips of 8 NeuronCore-v3; per chip 1,299 FP8 / 667 BF16 / 181
    # FP32 TFLOPS (dense), 96 GiB at 2.9 TB/s; 3.2 Tbps EFAv3 per trn2.48xlarge. NxD's trn2 recipes run
    # LNC=2 (2 physical cores per rank): 64 ranks per node, a quarter of a chip each.
    # NeuronLink-v3: 1 TB/s per chip assumed (AWS re:Invent 2024), a quarter per rank.
    'trn2.48xlarge': Cluster('trn2.48xlarge', 'xla', 64, {'bf16': 667e12 / 4, 'fp32': 181e12 / 4, 'fp8': 1299e12 / 4},
                             24 * GiB, 2.9e12 / 4, 256 * GB, 10e-6, 400 * GB / 64, 30e-6, matmul_eff=0.55,
                             attn_eff=0.35,
                             source='Neuron docs trainium2.html (datasheet); NeuronLink-v3 bandwidth assumed'),
    # NVIDIA H100 SXM5 datasheet: 1,979 TFLOPS FP8 dense (3,958 with sparsity), 989 BF16 dense, 67 FP32
    # (non-tensor; TF32 is 494), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (both ways: 450 one way);
    # p5.48xlarge / DGX H100: 8 GPUs, 3,200 Gbps EFA or 8 x 400 Gb/s IB per node = 50 GB/s per GPU.
    # matmul_eff 0.7: cuBLAS bf16 GEMMs at LLM shapes reach ~650-750 TFLOPS (NVIDIA's and public microbenchmarks).
    'h100': Cluster('h100', 'cuda', 8, {'bf16': 989e12, 'fp32': 67e12, 'fp8': 1979e12}, 80 * GB, 3.35e12, 450 * GB,
                    5e-6, 50 * GB, 10e-6, matmul_eff=0.6, attn_eff=0.35,
                    source='NVIDIA H100 SXM datasheet; AWS p5 / DGX H100 networking'),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS BF16 dense, 19.5 FP32, 2,039 GB/s, NVLink 3 600 GB/s
    # (300 one way); DGX A100: 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU (p4d: 400 Gbps per node).
    # matmul_eff 0.8: A100 bf16 GEMMs at large shapes reach ~250 TFLOPS; attn_eff 0.5: FlashAttention-2's
# ~150-190 TFLOPS forward + backward on A100 (its paper; Megatron's 2021 fused softmax was slower).
    'a100': Cluster('a100', 'cuda', 8, {'bf16': 312e12, 'fp32': 19.5e12}, 80 * GB, 2.039e12, 300 * GB, 5e-6,
                    25 * GB, 10e-6, matmul_eff=0.8, attn_eff=0.5,
                    source='NVIDIA A100 SXM4 datasheet; DGX A100 networking'),
    # Google Cloud TPU v5p docs: 459 TFLOPS BF16, 95 GiB HBM2e at 2,765 GB/s, ICI 4,800 Gbps per chip
    # (3D torus; 600 GB/s over 6 links: ~200 GB/s one way along one ring); 4 chips per host. A slice
    # is one ICI domain, so "inter-node" here is still ICI (DCN between slices is not modelled).
    'tpu-v5p': Cluster('tpu-v5p', 'xla', 4, {'bf16': 459e12, 'fp32': 459e12 / 4}, 95 * GiB, 2.765e12,
                       200 * GB, 5e-6, 200 * GB, 5e-6, matmul_eff=0.7, attn_eff=0.5,
                       source='cloud.google.com/tpu/docs/v5p (datasheet)'),
}

# `local` before --calibrate: this repo's 2-core dev machine as docs/performance.md measured it
# (fp32 matmul ~55-300 GFLOP/s with 2 threads: very loaded to quiet). Run --calibrate.
LOCAL_DEFAULT = Cluster('local', 'cpu', 2, {'fp32': 60e9, 'bf16': 3e9}, 8 * GiB, 5 * GB, 2 * GB, 50e-6,
                        2 * GB, 50e-6, matmul_eff=1.0, attn_eff=0.5, link_eff=1.0,
                        source='defaults (uncalibrated): run python -m tools.plan --calibrate')


def names() -> list:
  return sorted(CLUSTERS) + ['local']


def local(path=None) -> Cluster:
  """The `local` entry --calibrate wrote (FLATRON_CLUSTER_FILE or ~/.cache/flatron/), else the
  uncalibrated defaults."""
  path = path or os.environ.get('FLATRON_CLUSTER_FILE', CACHE)
  if not os.path.isfile(path):
    return LOCAL_DEFAULT
  with open(path) as f:
    fields = json.load(f)
  # An entry another flatron version wrote: figures this one does not model are dropped (they
  # only refine a prediction); one it needs and lacks is an error with the fix.
  known = {f.name for f in dataclasses.fields(Cluster)}
  unknown = sorted(set(fields) - known)
  if unknown:
    logging.warning('%s: ignoring %s, which this version of flatron does not model (written by another '
                    'version?); python -m tools.plan --calibrate rewrites the file', path, ', '.join(unknown))
  try:
    return Cluster(**{k: v for k, v in fields.items() if k in known})
  except TypeError as e:
    raise ValueError(f'{path}: not a cluster entry this version of flatron reads ({e}); re-run '
                     'python -m tools.plan --calibrate (or delete the file: uncalibrated defaults; or set '
                     'trainer.plan_cluster=none: no prediction in the summary)') from e


def write_local(cluster: Cluster, path=None) -> str:
  path = path or os.environ.get('FLATRON_CLUSTER_FILE', CACHE)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    json.dump(dataclasses.asdict(cluster), f, indent=1)
  return path


def get(name: str) -> Cluster:
  """The cluster called `name`; a ValueError naming the known ones otherwise."""
  if name == 'local':
    return local()
  if name not in CLUSTERS:
    raise ValueError(f'--cluster={name}: no such cluster; known: {", ".join(names())} '
                     '(add one to estimates/clusters.py with its sources)')
  return CLUSTERS[name]
