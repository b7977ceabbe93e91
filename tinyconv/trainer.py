"""The training loop: batches, SGD steps, evaluation, metrics, checkpoints, summary.

One step: take a batch of uint8 images, augment (random crop + flip), normalise per channel, forward +
loss + backward, SGD update; the batch is made ahead on a thread (``tinyconv/prefetch.py``). Given the
runtime ``tinyconv.distribute`` returns (a :class:`~tinyconv.parallel.Parallel`), the loop hands it each
batch's forward and backward; without one it runs them on the master.

Resuming is bit-identical: the checkpoint (``tinyconv/checkpoint.py``) keeps everything a step reads,
both random generators' states and the split included. However training ends (an error, Ctrl-C,
SIGTERM: ``tinyconv/stopping.py``) it checkpoints a whole step: a step cut short is rolled back first
(batch-norm's running statistics are the only state it changes before its update), and the update runs
with signals held until it is done.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tinyconv.checkpoint import (
    Checkpoint,
    check_resumable,
    plan_of,
    read_checkpoint,
    restore_plan,
    save_checkpoint,
)
from tinyconv.data import Dataset, Normalizer, augment, channel_stats
from tinyconv.metrics import MetricsWriter
from tinyconv.model import Network
from tinyconv.optim import SGD
from tinyconv.parallel import Parallel, forward_backward
from tinyconv.prefetch import Batch, Prefetcher
from tinyconv.report import Tally, summarize
from tinyconv.schedule import learning_rate
from tinyconv.stopping import SignalGuard
from tinyconv.story import Story, hide_bars, say
from tinyconv.train_config import TrainConfig, planned_steps

PROGRESS_EVERY = 100  # steps between progress lines where no bar can be drawn (a log, a pipe): 30 s of the quick preset


class Trainer:
    def __init__(
        self,
        net: Network,
        data: Dataset,
        config: TrainConfig,
        metrics: MetricsWriter | None = None,
        cluster: Parallel | None = None,
    ) -> None:
        self.net, self.data, self.cfg = net, data, config
        self.metrics = metrics or MetricsWriter(None)
        self.cluster = cluster
        self.normalize = Normalizer(*channel_stats(data.x_train))
        layer_lr = {net.layers[-1].name: config.classifier_lr} if config.classifier_lr != 1.0 else None
        self.opt = SGD(net, config.lr, config.momentum, config.weight_decay, layer_lr)
        # separate streams, so turning augmentation on/off does not change the order
        self.shuffle_rng = np.random.default_rng([config.seed, 1])
        self.augment_rng = np.random.default_rng([config.seed, 2])
        self.steps_per_epoch, self.total_steps, self.warmup_steps = planned_steps(len(data.x_train), config)
        # progress: the epoch in course, batches done in it, and the shuffle state it began with
        self.step = self.epoch = self.batch_in_epoch = 0
        self.epoch_shuffle_state = self.shuffle_rng.bit_generator.state
        self.history: list[dict[str, Any]] = []
        self.tally = Tally()  # the steps' records, aggregated as they come: memory stays flat however long the run
        self.story = Story()  # the terminal's lines, from what the metrics file gets
        self.saved: tuple[int, str] | None = None  # (step, path) of the last checkpoint written
        self.save_error: str | None = None  # why the checkpoint on the way out failed
        self.plan_restored = False  # resume took up the checkpoint's split
        self._saved_at = time.monotonic()
        self.signals = SignalGuard()  # Ctrl-C and SIGTERM as Stopped, held while an update runs
        self._whole = True  # False while an update is half done: nothing to checkpoint then

    # ---- one step ------------------------------------------------------------
    def train_step(self, xb: np.ndarray, yb: np.ndarray) -> tuple[float, float, dict[str, Any]]:
        """One SGD step on a uint8 batch, outside the loop (nothing counted or written).
        Returns (loss, batch accuracy, timing record)."""
        t0 = time.perf_counter()
        x = self._prepare(xb, self.augment_rng)
        data_wait = time.perf_counter() - t0
        loss, logits = self._forward_backward(x, yb)
        self._update()
        return (loss, *self._record(t0, logits, yb, data_wait))

    def _prepare(self, xb: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 (B, C, H, W) -> float32 (B, C, H, W): augmented (drawing from ``rng``) and normalised."""
        return self.normalize(augment(xb, rng) if self.cfg.augment else xb)

    def _batches(self, order: np.ndarray, first: int, last: int) -> Prefetcher:
        """Batches ``first``..``last - 1`` of the epoch shuffled as ``order``, made ahead (``prefetch``)."""
        x, y, bs = self.data.x_train, self.data.y_train, self.cfg.batch_size

        def make(b: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
            idx = order[b * bs : (b + 1) * bs]
            return self._prepare(x[idx], rng), y[idx]

        return Prefetcher(make, range(first, last), self.augment_rng.bit_generator.state, self.cfg.prefetch)

    def _forward_backward(self, x: np.ndarray, yb: np.ndarray) -> tuple[float, Any]:
        """Forward, loss, backward on a prepared float32 batch: every grad filled, no parameter changed yet."""
        train_batch = forward_backward if self.cluster is None else self.cluster.train_batch
        loss, logits = train_batch(self.net, x, yb, self.cfg.label_smoothing)
        if not np.isfinite(loss):  # before the update, which would spread it to every parameter
            raise FloatingPointError(
                f"loss became {loss} at step {self.step + 1}: lower --lr (now {self.cfg.lr}) or use --norm batch"
            )
        return loss, logits

    def _update(self) -> None:
        self.opt.lr = learning_rate(self.step, self.total_steps, self.cfg.lr, self.cfg.schedule, self.warmup_steps)
        self.opt.step()

    def _record(self, t0: float, logits: Any, yb: np.ndarray, data_wait: float) -> tuple[float, dict[str, Any]]:
        """The step's batch accuracy and its metrics record: times (from ``t0``) and, distributed, its split."""
        be = self.net.backend
        acc = float(np.mean(be.to_numpy(logits).argmax(axis=1) == yb))
        be.synchronize()
        dt = time.perf_counter() - t0
        split = {"comm_s": 0.0, "conv_s": 0.0, "bytes_sent": 0, "bytes_recv": 0, "shares": {}}
        if self.cluster is not None:
            split.update(self.cluster.last_step)
        split["comp_s"] = max(0.0, dt - split["comm_s"] - split["conv_s"])
        return acc, {"lr": self.opt.lr, "time_s": dt, "data_wait_s": data_wait, **split}

    def _step(self, batches: Prefetcher) -> tuple[float, float]:
        """The next step of the loop, whole or not at all: cut short, it is rolled back; its update,
        recorded and counted, runs with signals held. Its time counts from asking for its batch."""
        be, layers = self.net.backend, self.net.leaves()
        # what a step changes before its update: batch-norm's running statistics, by (layer index, name)
        undo = {(i, name): be.to_numpy(a).copy() for i, layer in enumerate(layers) for name, a in layer.buffers.items()}
        t0 = time.perf_counter()
        try:
            batch: Batch = batches.next()
            loss, logits = self._forward_backward(batch.x, batch.y)
        except BaseException:
            with self.signals.held(raise_pending=False):
                for (i, name), a in undo.items():
                    layers[i].buffers[name] = be.asarray(a)
            raise
        with self.signals.held():
            self._whole = False
            self._update()
            self.augment_rng.bit_generator.state = batch.rng_state  # the batch's draws, now committed
            self.step += 1
            self.batch_in_epoch = batch.index + 1
            self._whole = True
            acc, rec = self._record(t0, logits, batch.y, batches.waited_s)
            self.tally.add(rec)
            self.metrics.write("step", epoch=self.epoch + 1, step=self.step, loss=loss, acc=acc, **rec)
            self.story.step(self.step, rec)
            self._write_cluster_events()
        return loss, acc

    def _write_cluster_events(self) -> None:
        """What happened to the cluster (workers lost or joined) into the metrics file, and onto the terminal."""
        if self.cluster is None:
            return
        for e in self.cluster.pop_events():
            self.metrics.write(e["event"], **{k: v for k, v in e.items() if k != "event"})
            self.story.event(e)

    # ---- evaluation -------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Mean loss and accuracy in eval mode (running batch-norm statistics), in batches of
        ``eval_batch_size`` (0: the training batch's size)."""
        be = self.net.backend
        total_loss, correct = 0.0, 0
        size = self.cfg.eval_batch_size or self.cfg.batch_size
        bar = tqdm(
            range(0, len(x), size), desc="evaluating", unit="batch", leave=False, disable=hide_bars(self.cfg.progress)
        )
        for i in bar:
            xb, yb = x[i : i + size], y[i : i + size]
            logits = self.net.predict(be.asarray(self.normalize(xb)))
            loss, _ = self.net.loss_fn(logits, yb)
            total_loss += loss * len(xb)
            correct += int(np.sum(be.to_numpy(logits).argmax(axis=1) == yb))
        return total_loss / len(x), correct / len(x)

    # ---- the loop -----------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until ``epochs`` or ``max_steps``, evaluating each epoch -> the summary. However training
        ends (an exception, Ctrl-C, SIGTERM as :class:`Stopped`) the last whole step is checkpointed."""
        self._saved_at = time.monotonic()
        with self.signals.installed():
            try:
                return self._fit()
            except BaseException:
                self._on_the_way_out()
                raise

    def _fit(self) -> dict[str, Any]:
        n_epochs = -(-self.total_steps // self.steps_per_epoch)
        epochs_bar = tqdm(
            total=n_epochs, initial=self.epoch, desc="epochs", unit="epoch", disable=hide_bars(self.cfg.progress)
        )
        while self.step < self.total_steps:
            t_epoch = time.perf_counter()
            losses, accs = self._train_epoch(n_epochs)
            record = self._end_epoch(losses, accs, time.perf_counter() - t_epoch, n_epochs)
            epochs_bar.update(1)
            epochs_bar.set_postfix(test_acc=f"{record['test_acc']:.3f}")
        epochs_bar.close()
        summary = summarize(self.history, self.tally, self.epoch, self.step)
        self.metrics.write("summary", **summary)
        return summary

    def _on_the_way_out(self) -> None:
        """Training ends by an exception: record the cluster's last events, checkpoint the last whole step."""
        with self.signals.held(raise_pending=False):  # a second Ctrl-C does not cut the checkpoint short
            with contextlib.suppress(Exception):  # the metrics file may be what failed; the checkpoint matters more
                self._write_cluster_events()
            if self.cfg.checkpoint and self._whole:
                try:
                    self.save(self.cfg.checkpoint)
                except Exception as e:  # the exception that ended training is the one to report
                    self.save_error = f"{type(e).__name__}: {e}"

    def _train_epoch(self, n_epochs: int) -> tuple[list[float], list[float]]:
        """The steps of the epoch in course, from where it stands to its end or to ``total_steps``."""
        self.shuffle_rng.bit_generator.state = self.epoch_shuffle_state
        order = self.shuffle_rng.permutation(len(self.data.x_train))
        last = min(self.steps_per_epoch, self.batch_in_epoch + self.total_steps - self.step)
        losses, accs = [], []
        bar = tqdm(
            range(self.batch_in_epoch, last),
            desc=f"epoch {self.epoch + 1}/{n_epochs}",
            unit="step",
            leave=False,
            disable=hide_bars(self.cfg.progress),
        )
        with self._batches(order, self.batch_in_epoch, last) as batches:  # the thread stops on the way out
            for _ in bar:
                loss, acc = self._step(batches)
                losses.append(loss)
                accs.append(acc)
                # the last 50 steps' training accuracy: a newcomer sees CIFAR-10 being learnt within the first epoch
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{np.mean(accs[-50:]):.1%}", lr=f"{self.opt.lr:.3g}")
                if bar.disable and self.cfg.progress and self.step % PROGRESS_EVERY == 0:  # a log has no bar
                    recent = 100 * np.mean(accs[-50:])
                    say(f"step {self.step:,}: loss {loss:.3f}, training accuracy {recent:.1f} % (last 50 steps)")
                if self._checkpoint_due():
                    with self.signals.held():
                        self._save_between_steps()
        bar.close()
        return losses, accs

    def _checkpoint_due(self) -> bool:
        """A step checkpoint is due; not at an epoch's end or the last step, whose follows the evaluation."""
        cfg = self.cfg
        if not cfg.checkpoint or self.batch_in_epoch == self.steps_per_epoch or self.step == self.total_steps:
            return False
        every = cfg.checkpoint_every is not None and self.step % cfg.checkpoint_every == 0
        late = cfg.checkpoint_minutes is not None and time.monotonic() - self._saved_at >= 60 * cfg.checkpoint_minutes
        return every or late

    def _end_epoch(self, losses: list[float], accs: list[float], train_s: float, n_epochs: int) -> dict[str, Any]:
        """Evaluate, record and report the epoch (or the part of it that ran); checkpoint."""
        finished, done = self.batch_in_epoch == self.steps_per_epoch, self.batch_in_epoch
        t_eval = time.perf_counter()
        test_loss, test_acc = self.evaluate(self.data.x_test, self.data.y_test)
        record = {
            "epoch": self.epoch + 1,
            "steps": self.step,
            "complete": finished,
            "train_loss": float(np.mean(losses)) if losses else None,
            "train_acc": float(np.mean(accs)) if accs else None,
            "test_loss": test_loss,
            "test_acc": test_acc,
            "time_s": train_s,
            "eval_s": time.perf_counter() - t_eval,
        }
        with self.signals.held():  # the epoch is done: recorded, counted and checkpointed at once
            self.history.append(record)
            self.metrics.write("epoch", **record)
            if finished:  # the next epoch starts from a fresh shuffle
                self.epoch_shuffle_state = self.shuffle_rng.bit_generator.state
                self.epoch += 1
                self.batch_in_epoch = 0
            if self.cfg.checkpoint:
                self._save_between_steps()
        say(self.story.epoch_line(record, n_epochs, self.steps_per_epoch, done))
        return record

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Checkpoint the trainer as it stands (between steps) at ``path``; returns its size in bytes."""
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "epoch_shuffle_state": self.epoch_shuffle_state,
            "augment_state": self.augment_rng.bit_generator.state,
            "model_config": self.net.config,
            "train_config": asdict(self.cfg),
            "history": self.history,
            "plan": plan_of(self.cluster),
        }
        size = save_checkpoint(path, self.net.state_dict(), self.opt.state_dict(), meta)
        self.saved = (self.step, str(path))
        self._saved_at = time.monotonic()
        return size

    def _save_between_steps(self) -> None:
        """A periodic or epoch-end checkpoint. One that cannot be written (a full disk) does not end the
        run: it is reported, the last checkpoint stays as it was (the write is atomic), and the next
        interval tries again."""
        try:
            self.save(self.cfg.checkpoint)
        except OSError as e:
            self._saved_at = time.monotonic()  # the next try is an interval away, not a step
            kept = f"the one of step {self.saved[0]} stays" if self.saved else "there is none yet"
            tqdm.write(
                f"warning: the checkpoint of step {self.step} could not be written ({e}); {kept}", file=sys.stderr
            )
            self.metrics.write("checkpoint_failed", step=self.step, error=f"{type(e).__name__}: {e}")

    def resume(self, source: str | Path | Checkpoint) -> str | None:
        """Restore everything ``save`` wrote from ``source`` (a path, or a checkpoint read); training then
        continues exactly as if never stopped. -> a line about the split, when distributed: taken up (same
        participants, sets ``plan_restored``) or not."""
        ck = source if isinstance(source, Checkpoint) else read_checkpoint(source)
        check_resumable(ck, self.net.config, self.cfg.batch_size, self.steps_per_epoch, self.warmup_steps)
        self.net.load_state_dict(ck.model)
        self.opt.load_state_dict(ck.optim)
        meta = ck.meta
        self.step, self.epoch, self.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        self.epoch_shuffle_state = meta["epoch_shuffle_state"]
        self.augment_rng.bit_generator.state = meta["augment_state"]
        self.history = meta.get("history", [])
        if self.cluster is not None:  # its steps count on from the checkpoint's (task headers, events)
            self.cluster.step = self.step
        note, restored = restore_plan(self.cluster, meta.get("plan"))
        self.plan_restored = self.plan_restored or restored
        return note
