"""The training loop: batches, SGD steps, evaluation, metrics, checkpoints, summary.

One step: take a batch of uint8 images, augment (random crop + flip), normalise per
channel, move to the backend, forward + loss + backward, SGD update. Convolutions
may be distributed (``tinyconv.distribute`` puts sharded layers in the network); the
loop is the same either way, it only asks the cluster for the step's comm/conv split
to record.

Resuming is bit-identical: the checkpoint keeps the parameters, the momentum
buffers, the global step, the position within the epoch, and the state of both
random generators (the epoch's shuffle and the augmentation).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from tinyconv.checkpoint import load_checkpoint, save_checkpoint
from tinyconv.data import Dataset, Normalizer, augment, channel_stats
from tinyconv.metrics import MetricsWriter
from tinyconv.model import Network
from tinyconv.optim import SGD
from tinyconv.report import format_table
from tinyconv.schedule import learning_rate

if TYPE_CHECKING:
    from tinyconv.shard.cluster import Cluster


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_epochs: float = 1.0
    max_steps: int | None = None  # stop after this many steps in total (smoke runs)
    augment: bool = True
    eval_batch_size: int = 500
    seed: int = 0
    checkpoint: str | None = None  # written at each epoch end and at the stop
    progress: bool = True


class Trainer:
    def __init__(
        self,
        net: Network,
        data: Dataset,
        config: TrainConfig,
        metrics: MetricsWriter | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self.net, self.data, self.cfg = net, data, config
        self.metrics = metrics or MetricsWriter(None)
        self.cluster = cluster
        self.normalize = Normalizer(*channel_stats(data.x_train))
        self.opt = SGD(net, config.lr, config.momentum, config.weight_decay)
        # separate streams, so turning augmentation on/off does not change the order
        self.shuffle_rng = np.random.default_rng([config.seed, 1])
        self.augment_rng = np.random.default_rng([config.seed, 2])
        n = len(data.x_train)
        self.steps_per_epoch = n // config.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch size {config.batch_size} is larger than the {n} training images")
        self.total_steps = self.steps_per_epoch * config.epochs
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.warmup_steps = int(config.warmup_epochs * self.steps_per_epoch)
        # progress: the epoch in course, batches done in it, and the shuffle state it began with
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.epoch_shuffle_state = self.shuffle_rng.bit_generator.state
        self.history: list[dict[str, Any]] = []
        self.step_times: list[float] = []
        self.step_splits: list[dict[str, Any]] = []

    # ---- one step ------------------------------------------------------------
    def train_step(self, xb: np.ndarray, yb: np.ndarray) -> tuple[float, float, dict[str, Any]]:
        """One SGD step on a uint8 batch. Returns (loss, batch accuracy, timing record)."""
        be = self.net.backend
        t0 = time.perf_counter()
        if self.cfg.augment:
            xb = augment(xb, self.augment_rng)
        logits = self.net.forward(be.asarray(self.normalize(xb)), training=True)
        loss, dlogits = self.net.loss_fn(logits, yb)
        self.net.backward(dlogits)
        self.opt.lr = learning_rate(self.step, self.total_steps, self.cfg.lr, self.cfg.schedule, self.warmup_steps)
        self.opt.step()
        acc = float(np.mean(be.to_numpy(logits).argmax(axis=1) == yb))
        be.synchronize()
        dt = time.perf_counter() - t0
        split = {"comm_s": 0.0, "conv_s": 0.0, "bytes_sent": 0, "bytes_recv": 0, "shares": {}}
        if self.cluster is not None:
            split.update(self.cluster.last_step)
        split["comp_s"] = max(0.0, dt - split["comm_s"] - split["conv_s"])
        if not np.isfinite(loss):
            raise FloatingPointError(
                f"loss became {loss} at step {self.step}: lower --lr (now {self.cfg.lr}) or use --norm batch"
            )
        return loss, acc, {"lr": self.opt.lr, "time_s": dt, **split}

    # ---- evaluation -------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Mean loss and accuracy in eval mode (running batch-norm statistics)."""
        be = self.net.backend
        total_loss, correct = 0.0, 0
        for i in range(0, len(x), self.cfg.eval_batch_size):
            xb, yb = x[i : i + self.cfg.eval_batch_size], y[i : i + self.cfg.eval_batch_size]
            logits = self.net.forward(be.asarray(self.normalize(xb)), training=False)
            loss, _ = self.net.loss_fn(logits, yb)
            total_loss += loss * len(xb)
            correct += int(np.sum(be.to_numpy(logits).argmax(axis=1) == yb))
        return total_loss / len(x), correct / len(x)

    # ---- the loop -----------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until ``epochs`` or ``max_steps``; evaluate each epoch; return the summary."""
        n_epochs = -(-self.total_steps // self.steps_per_epoch)
        epochs_bar = tqdm(
            total=n_epochs, initial=self.epoch, desc="epochs", unit="epoch", disable=not self.cfg.progress
        )
        while self.step < self.total_steps:
            t_epoch = time.perf_counter()
            losses, accs = self._train_epoch(n_epochs)
            record = self._end_epoch(losses, accs, time.perf_counter() - t_epoch)
            epochs_bar.update(1)
            epochs_bar.set_postfix(test_acc=f"{record['test_acc']:.3f}")
        epochs_bar.close()
        summary = self.summary()
        self.metrics.write("summary", **summary)
        return summary

    def _train_epoch(self, n_epochs: int) -> tuple[list[float], list[float]]:
        """The steps of the epoch in course, from where it stands to its end or to ``total_steps``."""
        x, y, bs = self.data.x_train, self.data.y_train, self.cfg.batch_size
        self.shuffle_rng.bit_generator.state = self.epoch_shuffle_state
        order = self.shuffle_rng.permutation(len(x))
        last = min(self.steps_per_epoch, self.batch_in_epoch + self.total_steps - self.step)
        losses, accs = [], []
        bar = tqdm(
            range(self.batch_in_epoch, last),
            desc=f"epoch {self.epoch + 1}/{n_epochs}",
            unit="step",
            leave=False,
            disable=not self.cfg.progress,
        )
        for b in bar:
            idx = order[b * bs : (b + 1) * bs]
            loss, acc, rec = self.train_step(x[idx], y[idx])
            losses.append(loss)
            accs.append(acc)
            self.step_times.append(rec["time_s"])
            self.step_splits.append(rec)
            self.metrics.write("step", epoch=self.epoch + 1, step=self.step + 1, loss=loss, acc=acc, **rec)
            self.step += 1
            self.batch_in_epoch = b + 1
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{rec['lr']:.3g}")
        bar.close()
        return losses, accs

    def _end_epoch(self, losses: list[float], accs: list[float], train_s: float) -> dict[str, Any]:
        """Evaluate, record and report the epoch (or the part of it that ran); checkpoint."""
        finished = self.batch_in_epoch == self.steps_per_epoch
        if finished:  # the next epoch starts from a fresh shuffle
            self.epoch_shuffle_state = self.shuffle_rng.bit_generator.state
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
        self.history.append(record)
        self.metrics.write("epoch", **record)
        train_loss = record["train_loss"] if losses else float("nan")
        tqdm.write(
            f"epoch {record['epoch']}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
            f"test acc {test_acc:.2%}  ({train_s:.1f} s train, {record['eval_s']:.1f} s eval)"
        )
        if finished:
            self.epoch += 1
            self.batch_in_epoch = 0
        if self.cfg.checkpoint:
            self.save(self.cfg.checkpoint)
        return record

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "epoch_shuffle_state": self.epoch_shuffle_state,
            "augment_state": self.augment_rng.bit_generator.state,
            "model_config": self.net.config,
            "train_config": asdict(self.cfg),
            "history": self.history,
        }
        save_checkpoint(path, self.net.state_dict(), self.opt.state_dict(), meta)

    def resume(self, path: str | Path) -> None:
        """Restore everything ``save`` wrote; training then continues exactly as if never stopped."""
        model, optim, meta = load_checkpoint(path)
        if meta["model_config"]["arch"] != self.net.config["arch"] or (
            meta["model_config"]["norm"] != self.net.config["norm"]
        ):
            saved, here = meta["model_config"], self.net.config
            raise ValueError(
                f"checkpoint {path} is for {saved['arch']} with {saved['norm']} norm, this run builds "
                f"{here['arch']} with {here['norm']}: use the same --arch/--norm to resume"
            )
        self.net.load_state_dict(model)
        self.opt.load_state_dict(optim)
        self.step = meta["step"]
        self.epoch = meta["epoch"]
        self.batch_in_epoch = meta["batch_in_epoch"]
        self.epoch_shuffle_state = meta["epoch_shuffle_state"]
        self.augment_rng.bit_generator.state = meta["augment_state"]
        self.history = meta.get("history", [])

    # ---- reporting --------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        full = [h["time_s"] for h in self.history if h["complete"]]
        out: dict[str, Any] = {
            "epochs": self.epoch + (0 if not self.history or last.get("complete") else 1),
            "steps": self.step,
            "train_loss": last.get("train_loss"),
            "test_loss": last.get("test_loss"),
            "test_acc": last.get("test_acc"),
            "best_test_acc": max((h["test_acc"] for h in self.history), default=None),
            "time_per_epoch_s": float(np.mean(full)) if full else None,
            "median_step_s": float(np.median(self.step_times)) if self.step_times else None,
        }
        if self.cluster is not None and self.step_splits:
            for k in ("comm_s", "conv_s", "comp_s"):
                out[f"median_{k}"] = float(np.median([s[k] for s in self.step_splits]))
            out["bytes_sent"] = int(sum(s["bytes_sent"] for s in self.step_splits))
            out["bytes_recv"] = int(sum(s["bytes_recv"] for s in self.step_splits))
            # each participant's, by name: the master's are 0 (it keeps its share)
            names = self.step_splits[-1]["participants"]
            for key in ("bytes_sent", "bytes_recv"):
                per = np.sum([s[f"participant_{key}"] for s in self.step_splits], axis=0)
                out[f"participant_{key}"] = {name: int(b) for name, b in zip(names, per, strict=True)}
            out["final_shares"] = self.step_splits[-1]["shares"]
            if self.step_splits[-1].get("channel_shares"):  # input channels, for layers split by them
                out["final_channel_shares"] = self.step_splits[-1]["channel_shares"]
        return out


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table for the terminal."""
    rows = []
    for key, value in summary.items():
        if value is None:
            continue
        if key in ("test_acc", "best_test_acc"):
            value = f"{value:.2%}"
        rows.append((key, value if not isinstance(value, dict) else _shares_text(value)))
    return format_table(("result", "value"), rows, title="Summary")


def _shares_text(shares: dict[str, Any]) -> str:
    return "; ".join(f"{layer}: {counts}" for layer, counts in shares.items())
