"""The rates a full-duplex emulated link must show (docs/bench.md, "Full duplex, per node")."""


def assert_full_duplex(rate_bps: float, one_way_bps: float, duplex_bps, info) -> None:
    """One direction alone: TCP over 1500-byte frames carries ~95% of the line rate. Both at once:
    each direction's ACKs queue behind the other's data in the same tbf, so each gets 73-97% of the
    rate (docs/bench.md); a link shared by the two directions would give each at most half and both
    together at most the rate."""
    assert 0.85 * rate_bps < one_way_bps < 1.02 * rate_bps, info
    assert all(0.6 * rate_bps < x < 1.02 * rate_bps for x in duplex_bps), info
    assert sum(duplex_bps) > 1.3 * rate_bps, info
