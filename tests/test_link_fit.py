"""tools/link_fit.py: the alpha-beta line and the measured curves of the collectives between
two local processes (the measurement itself is a benchmark)."""
import pytest

from tools import link_fit


def test_fit_recovers_alpha_and_beta():
  lat, bw = 50e-6, 2e9
  # g = 2, n the bytes each rank gives: all-reduce 2(alpha + n / 2B), all-gather and p2p alpha + n / B
  figures = {size: {'all_reduce': 2 * (lat + 4 * size / 2 / bw), 'all_gather': lat + 4 * size / bw,
                    'reduce_scatter': lat + 4 * size / 2 / bw, 'p2p': lat + 4 * size / bw}
             for size in link_fit.SIZES}
  got_bw, got_lat = link_fit.fit(figures)
  assert got_lat == pytest.approx(lat)
  assert got_bw == pytest.approx(bw)
  # one operation's own figures: gloo's p2p here is ~10x quicker to start than its all-reduce
  figures = {size: dict(ops, p2p=lat / 10 + 4 * size / (2 * bw)) for size, ops in figures.items()}
  assert link_fit.fit(figures, 'p2p') == pytest.approx((2 * bw, lat / 10))
  assert link_fit.fit(figures, 'all_reduce') == pytest.approx((bw, lat))
  # the measured points as the planner's formulas read their n: all-gather's is its output
  times = link_fit.op_times(figures)
  size = link_fit.SIZES[1]
  assert [8 * size, figures[size]['all_gather']] in times['all_gather'] == times['all_to_all']
  assert [4 * size, figures[size]['all_reduce']] in times['all_reduce']
