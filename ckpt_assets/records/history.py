"""A training run's checkpoint history across attempts, as a table and a loss plot.

Shown on the final `model_checkpoint` output and on `final_model`: one row per committed checkpoint of the
training run (step, loss, eval metrics, attempt, checkpoint, and where an attempt resumed),
from the partition's checkpoint observations in the instance plus what this attempt
reported (its own observations may not be stored yet when this is built). The instance,
not the store, is the source: retention deletes old checkpoints, their observations stay. Bounded to the last `MAX_ROWS` checkpoints by step.

The loss curve is there twice. `loss_plot` is text, a sparkline of the loss (one bar per
checkpoint, a dotted rule at each resume): Dagster 1.13 has no image metadata and shows a
Markdown value only behind its "[Show Markdown]" toggle, while a text value reads in the
metadata table itself. `loss_plot_image` is the full plot, a PNG (matplotlib, Agg) embedded
as a base64 data URI in Markdown, one click away; no file has to outlive the run for either
to show.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import dagster as dg

from ckpt_assets.base.events import CHECKPOINT, partition_events
from trainer.checkpoints.records import CheckpointRecord

MAX_ROWS = 1000
MAX_EVAL_COLUMNS = 6  # a task may report many eval metrics; the table stays readable

BASE_COLUMNS = [("step", "int"), ("attempt", "int"), ("loss", "float")]
TAIL_COLUMNS = [("checkpoint", "string"), ("resumed", "bool"), ("resumed_from_step", "int"),
                ("recorded_late", "bool")]


def _row(name: str, step: Any, attempt: Any, loss: Any, ev: Any, resumed_from: Any,
         late: bool) -> dict[str, Any]:
    return {"checkpoint": name, "step": step, "attempt": attempt, "loss": loss,
            "eval": ev if isinstance(ev, dict) else {}, "resumed_from_step": resumed_from,
            "recorded_late": bool(late)}


def _instance_rows(instance: dg.DagsterInstance, run: str, limit: int) -> list[dict[str, Any]]:
    """The partition's newest `limit` checkpoint observations, oldest first (a checkpoint
    recorded twice, e.g. late and by its own attempt, is one row)."""
    rows: dict[str, dict[str, Any]] = {}
    for md, _ in partition_events(instance, run, CHECKPOINT, newest_first=True, limit=2 * limit):
        name = md.get("name")
        if name and len(rows) < limit:
            rows[name] = _row(name, md.get("step"), md.get("attempt"), md.get("loss"),
                              md.get("eval"), md.get("resumed_from_step"),
                              md.get("recorded_late"))
    return list(reversed(rows.values()))


def history_frame(instance: dg.DagsterInstance, run: str,
                  reported: Iterable[CheckpointRecord] = (), limit: int = MAX_ROWS):
    """pandas DataFrame of the run's checkpoints, oldest step first, at most `limit` rows."""
    import pandas as pd

    rows = {r["checkpoint"]: r for r in _instance_rows(instance, run, limit)}
    for rec in reported:
        rows.setdefault(rec.name, _row(rec.name, rec.step, rec.attempt, rec.loss, rec.eval,
                                       rec.lineage.resumed_from_step if rec.lineage else None,
                                       False))
    # Sorted: the same columns in the same order whatever order a task reported them in.
    evals = sorted({k for r in rows.values() for k in r["eval"]})[:MAX_EVAL_COLUMNS]
    records = []
    for r in rows.values():
        rec = {k: v for k, v in r.items() if k != "eval"}
        for k in evals:
            rec[f"eval_{k}"] = r["eval"].get(k)
        records.append(rec)
    cols = ([c for c, _ in BASE_COLUMNS] + [f"eval_{k}" for k in evals]
            + [c for c, _ in TAIL_COLUMNS])
    df = pd.DataFrame.from_records(records, columns=cols)
    if df.empty:
        return df.assign(resumed=pd.Series(dtype=bool))
    for c in ("step", "attempt", "resumed_from_step"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("Int64")
    for c in ["loss", *[f"eval_{k}" for k in evals]]:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    df = df.sort_values(["step", "attempt"], kind="stable").tail(limit).reset_index(drop=True)
    # The resume marker: the first checkpoint an attempt committed after resuming.
    first_of_attempt = ~df.duplicated("attempt", keep="first")
    df["resumed"] = (first_of_attempt & df["resumed_from_step"].notna()).astype(bool)
    return df


def _plain(v: Any) -> Any:
    """A pandas cell as a value a TableRecord takes (NA/NaN -> None, numpy -> Python)."""
    if v is None:
        return None
    try:
        import pandas as pd

        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def table_metadata(df) -> dg.MetadataValue:
    types = dict(BASE_COLUMNS + TAIL_COLUMNS)
    schema = dg.TableSchema(columns=[
        dg.TableColumn(c, types.get(c, "float")) for c in df.columns])
    records = [dg.TableRecord({c: _plain(v) for c, v in row.items()})
               for row in df.to_dict(orient="records")]
    return dg.MetadataValue.table(records=records, schema=schema)


def loss_plot_png(df) -> bytes:
    """Loss versus step, one colour per attempt, a dashed line at each resume."""
    # The Agg canvas on a bare Figure, not pyplot: no display and no global backend
    # switch inside a run worker that other code shares.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for attempt, part in df.groupby("attempt", sort=True):
        part = part.dropna(subset=["loss"])
        if not part.empty:
            ax.plot(part["step"].astype(float), part["loss"], marker=".",
                    label=f"attempt {attempt}")
    for _, row in df[df["resumed"]].iterrows():
        at = float(row["resumed_from_step"])
        ax.axvline(at, linestyle="--", color="grey", linewidth=1)
        ax.annotate(f"resumed (a{row['attempt']})", (at, 1), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if len(df):
        ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def resumes_words(df) -> str:
    """Where the run resumed, in words ("none" for a run never interrupted)."""
    return ", ".join(f"attempt {r['attempt']} from step {r['resumed_from_step']}"
                     for _, r in df[df["resumed"]].iterrows()) or "none"


BARS = "▁▂▃▄▅▆▇█"
RESUME_MARK = "┊"  # before the first checkpoint of an attempt that resumed
NO_LOSS = "·"  # a checkpoint that reported no (finite) loss
SPARK_WIDTH = 80  # checkpoints drawn, the newest; the table and the image have them all


def loss_sparkline(df) -> str:
    """The loss curve as one line of text: first loss, a bar per checkpoint scaled between
    the smallest and largest loss drawn, last loss, and what it spans."""
    rows = df.tail(SPARK_WIDTH)
    losses = [float(v) for v in rows["loss"] if v is not None and math.isfinite(float(v))]
    if not losses:
        return f"no loss reported ({len(df)} checkpoints)"
    lo, hi = min(losses), max(losses)
    marks = []
    for _, r in rows.iterrows():
        if r["resumed"]:
            marks.append(RESUME_MARK)
        loss = r["loss"]
        if loss is None or not math.isfinite(float(loss)):
            marks.append(NO_LOSS)
        else:
            marks.append(BARS[round((float(loss) - lo) / (hi - lo) * (len(BARS) - 1))
                              if hi > lo else 0])
    return (f"{losses[0]:.4g} {''.join(marks)} {losses[-1]:.4g}  (loss at steps "
            f"{rows['step'].iloc[0]}–{rows['step'].iloc[-1]}, {len(rows)} of {len(df)} "
            f"checkpoints; {RESUME_MARK} resumed: {resumes_words(df)})")


def plot_metadata(df, png: bytes | None = None) -> dg.MetadataValue:
    png64 = base64.b64encode(png or loss_plot_png(df)).decode("ascii")
    return dg.MetadataValue.md(
        f"![loss versus step](data:image/png;base64,{png64})\n\n"
        f"{len(df)} checkpoints; resumes (dashed): {resumes_words(df)}")


@dataclass(frozen=True)
class LossHistory:
    metadata: dict[str, Any]  # `metrics_history`, `loss_plot`, `loss_plot_image`, `resumes`
    png: bytes | None  # the plot itself, for MLflow


def loss_history(instance: dg.DagsterInstance, run: str,
                 reported: Iterable[CheckpointRecord] = (), log=None) -> LossHistory:
    """The run's checkpoint history as metadata, and its plot; best-effort: a failure to
    build them is a warning, never a failed training run."""
    try:
        df = history_frame(instance, run, reported)
        png = loss_plot_png(df)
        return LossHistory({"metrics_history": table_metadata(df),
                            "loss_plot": dg.MetadataValue.text(loss_sparkline(df)),
                            "loss_plot_image": plot_metadata(df, png),
                            "resumes": resumes_words(df)}, png)
    except Exception as e:
        if log:
            log.warning(f"checkpoint history table/plot not built ({type(e).__name__}: {e})")
        return LossHistory({}, None)


def history_metadata(instance: dg.DagsterInstance, run: str,
                     reported: Iterable[CheckpointRecord] = (), log=None) -> dict[str, Any]:
    """`metrics_history` (table), `loss_plot` (a text sparkline), `loss_plot_image`
    (Markdown with the PNG) and `resumes` (where the run resumed, "none" if it never was
    interrupted)."""
    return loss_history(instance, run, reported, log).metadata
