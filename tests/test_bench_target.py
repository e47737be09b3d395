"""Time to target at 2% resolution (docs/bench.md, "Time to target"): the evaluation grid of --eval-every
goes dense near the target, early enough that the next grid interval cannot jump past it unseen."""
from deepspeed_acco.bench.running.train import MIN_TARGET_MARGIN, TargetWatch, is_eval_update


def _crossing(losses, target, eval_every, updates):
    """The first update at which a run with these per-update losses is seen at or below ``target``."""
    watch = TargetWatch(target, updates)
    watch.on_grid(losses[0])
    for update in range(1, len(losses)):
        on_grid = is_eval_update(update, eval_every, updates)
        if on_grid or watch.evaluate_now(update, False):
            if on_grid:
                watch.on_grid(losses[update])
            if losses[update] <= target:
                return update, watch
    return None, watch


def test_dense_evaluation_finds_the_crossing_to_the_update():
    # A loss falling 1% per update from 3.0; the target lies between grid points 50 and 55.
    losses = [3.0 * 0.99 ** u for u in range(160)]
    target = losses[52] * 1.001  # first reached at update 52
    update, watch = _crossing(losses, target, eval_every=5, updates=50)
    assert watch.every == 1 and update == 52  # the grid alone would say 55: 10% late
    # A run that never nears the target stays on the grid.
    flat = [3.0] * 60
    update, watch = _crossing(flat, 2.0, eval_every=5, updates=50)
    assert update is None and not watch.dense


def test_resolution_is_two_percent_of_the_updates_and_the_margin_follows_the_drops():
    assert TargetWatch(1.0, 240).every == 4 and TargetWatch(1.0, 50).every == 1
    watch = TargetWatch(2.0, 240)
    watch.on_grid(2.2)
    assert not watch.dense
    watch.on_grid(2.1)  # dropped 4.5% in one grid interval: dense from within 6.8% of the target
    assert watch.dense and watch.largest_drop > 0.04
    slow = TargetWatch(2.0, 240)
    slow.on_grid(2.0 * (1 + 2 * MIN_TARGET_MARGIN))
    assert not slow.dense  # no drop seen yet: only within the minimum margin
    assert not TargetWatch(None, 50).evaluate_now(10, False)
