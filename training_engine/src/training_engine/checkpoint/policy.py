"""When to save: the rules of ``cfg.checkpoint`` (every N steps, every N epochs, a
new best of ``save_best.monitor``, a stop signal, the last step) and how many
checkpoints can be on disk at once. Plain functions of the config group (every key
there: schema.section): the manager applies them at every step, preflight asks them
for the plan.
docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Any

from .folder import MIN_KEEP


def _best_rule(ck: Any) -> Any:
    """``checkpoint.save_best`` when it is on (and names a metric), else None."""
    rule = ck.save_best
    return rule if rule.enabled and rule.monitor else None


def new_best(ck: Any, step: int, book: Any) -> dict[str, Any] | None:
    """The best checkpoint's record when ``save_best.monitor``'s value logged at ``step``
    was a new best (the run's MetricBook decides); None otherwise."""
    rule = _best_rule(ck)
    if rule is None or not book.new_best_at(step, rule.monitor, rule.mode):
        return None
    best = book.best_of(rule.monitor, rule.mode)
    return {"step": step, "monitor": best.name, "value": best.value}


def watch_best(ck: Any, book: Any) -> None:
    """Ask the book to keep ``save_best.monitor``'s best (from the start of the run)."""
    rule = _best_rule(ck)
    if rule is not None:
        book.watch(rule.monitor, rule.mode)


def save_reasons(
    ck: Any,
    *,
    step: int,
    epoch: int,
    batch: int,
    batches_per_epoch: int | None,  # None: a stream (no epoch end to save at)
    is_new_best: bool,
    stop: bool,
) -> list[str]:
    """Why a checkpoint is due at this optimizer-step boundary (empty: it is not)."""
    reasons = []
    every_steps, every_epochs = ck.every_n_steps, ck.every_n_epochs
    if every_steps and step % every_steps == 0:
        reasons.append("every_n_steps")
    if every_epochs and batch == batches_per_epoch and (epoch + 1) % every_epochs == 0:
        reasons.append("every_n_epochs")
    if is_new_best:
        reasons.append("best")
    if ck.save_on_signal and stop:
        reasons.append("signal")
    return reasons


def planned_saves(
    ck: Any,
    total: int,
    start: int,
    *,
    steps_per_epoch: int | None,
    evaluations: set[int],
) -> set[int]:
    """Steps in (start, total] that may save (a new best: at most every evaluation)."""
    if not ck.enabled or start >= total:
        return set()

    def multiples(k: int | None) -> set[int]:
        return set(range((start // k + 1) * k, total + 1, k)) if k else set()

    saves = multiples(ck.every_n_steps)
    if ck.every_n_epochs and steps_per_epoch:  # a stream has no epoch length
        saves |= multiples(ck.every_n_epochs * steps_per_epoch)
    if _best_rule(ck) is not None:
        saves |= evaluations
    if ck.save_last:
        saves.add(total)
    return saves


def kept_on_disk(ck: Any) -> tuple[int, str]:
    """How many checkpoints can be on disk at once, and why that many."""
    keep = max(MIN_KEEP, ck.keep_last)
    best = 1 if _best_rule(ck) is not None else 0
    return keep + best + 1, f"keep_last {keep}{' + best' if best else ''} + 1 in flight"
