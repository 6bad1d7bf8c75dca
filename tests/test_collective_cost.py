"""estimates/collective_cost.py: the alpha-beta collectives, which links a group uses, and the
measured curves of `local`."""
import dataclasses

import pytest

from estimates import clusters, collective_cost

H100 = clusters.CLUSTERS['h100']


def test_alpha_beta_rings():
  n, bw, lat = 8e6, 1e9, 1e-5
  assert collective_cost.all_reduce(n, 4, bw, lat) == pytest.approx(2 * 3 * (lat + n / 4 / bw))
  assert collective_cost.all_gather(n, 4, bw, lat) == pytest.approx(3 * (lat + n / 4 / bw))
  assert collective_cost.reduce_scatter(n, 4, bw, lat) == collective_cost.all_gather(n, 4, bw, lat)
  assert collective_cost.p2p(n, bw, lat) == pytest.approx(lat + n / bw)
  assert collective_cost.all_reduce(n, 1, bw, lat) == collective_cost.all_gather(n, 1, bw, lat) == 0


def test_links_inside_and_across_nodes():
  eff = H100.link_eff
  assert collective_cost.link(H100, 8) == (H100.intra_bw * eff, H100.intra_lat)          # tp8 in a node
  assert collective_cost.link(H100, 2, 4) == (H100.intra_bw * eff, H100.intra_lat)       # 2 ranks 4 apart
  # dp over nodes with tp8: one member per node, the node's NIC share per device
  assert collective_cost.link(H100, 4, 8) == (H100.inter_bw * eff, H100.inter_lat)
  # 16 ranks 2 apart: 4 of the group per node share the crossing
  assert collective_cost.link(H100, 16, 2) == (min(H100.intra_bw, 4 * H100.inter_bw) * eff, H100.inter_lat)


def test_measured_collectives_are_interpolated_per_operation_between_two_ranks():
  """local's op_times (link_fit.op_times): the time of a collective is the line through the
  measured sizes around its bytes, read back through the op's own alpha-beta formula."""
  curve = [[8, 4e-4], [524288, 2.4e-3], [16777216, 1.2e-2]]
  local = dataclasses.replace(clusters.LOCAL_DEFAULT, op_times={'all_reduce': curve, 'p2p': [[8, 6e-5], [4e6, 3e-3]]})
  for n, seconds in curve:
    assert collective_cost.collective(local, 'all_reduce', n, 2) == pytest.approx(seconds)
  halfway = (curve[1][0] + curve[2][0]) / 2
  assert collective_cost.collective(local, 'all_reduce', halfway, 2) == pytest.approx((curve[1][1] + curve[2][1]) / 2)
  assert collective_cost.collective(local, 'p2p', 2e6, 2) == pytest.approx((6e-5 + 3e-3) / 2, rel=1e-5)
  # past the last size: the last segment's slope; an op without a curve: the alpha-beta figures
  assert collective_cost.collective(local, 'all_reduce', 2 * 16777216, 2) == pytest.approx(
      1.2e-2 + 16777216 * (1.2e-2 - 2.4e-3) / (16777216 - 524288))
  assert collective_cost.collective(local, 'all_gather', 1e6, 2) == collective_cost.all_gather(1e6, 2, *collective_cost.link(local, 2))
