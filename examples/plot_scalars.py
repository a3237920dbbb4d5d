"""Draw the scalars of a TensorBoard log as one PNG: a panel per event name, against the step.

    python examples/plot_scalars.py runs/zero3_demo docs/images/demo_scalars.png

It reads the event files the `tensorboard` monitor wrote (TensorBoard's own reader) and draws
every scalar tag, so a run can be looked at without starting a TensorBoard server; it made
the picture in docs/observability.md from a `make demo` run. Needs `tensorboard` and
`matplotlib` (`pip install tensorboard matplotlib`).
"""

import argparse
import math
import sys


def read_scalars(log_dir: str) -> dict:
    """`{tag: [(step, value), ...]}` of every scalar under `log_dir`."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise SystemExit(f"plot_scalars needs tensorboard ({err}); pip install tensorboard") from err
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def plot(scalars: dict, out_path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no screen needed
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(f"plot_scalars needs matplotlib ({err}); pip install matplotlib") from err
    tags = sorted(scalars)
    cols = min(3, len(tags))
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        steps, values = zip(*scalars[tag])
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(tag, fontsize=9)
        ax.set_xlabel("step (samples seen)" if tag.startswith("Train/Samples/") else "step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "log_dir", help="a folder of TensorBoard event files (the monitor's output_path/job_name)"
    )
    parser.add_argument("out_png", help="the picture to write")
    parser.add_argument("--title", default=None, help="the figure's title (default: the log folder)")
    args = parser.parse_args(argv)
    scalars = read_scalars(args.log_dir)
    if not scalars:
        print(f"plot_scalars: no scalars under {args.log_dir}", file=sys.stderr)
        return 1
    plot(scalars, args.out_png, args.title or args.log_dir)
    print(f"wrote {args.out_png}: {len(scalars)} scalar(s): {', '.join(sorted(scalars))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
