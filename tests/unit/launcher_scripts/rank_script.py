"""A rank for the launcher tests: reports what the launcher gave it, then acts out --mode.

report:     print one JSON line with the rank's environment and arguments.
fail:       rank 0 records its pid and sleeps 60 s; rank 1 waits for that, then exits 3.
sigterm:    record a ready marker, sleep until SIGTERM arrives, record it, exit 0.
follow:     call deepspeed's follow_launcher() (as init_distributed does), record the pid, sleep 60 s.
"""

import argparse
import json
import os
import signal
import sys
import time


def wait_for(path: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.02)


def write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # readers never see a half-written file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--mode", default="report", choices=["report", "fail", "sigterm", "follow"])
    parser.add_argument("--dir", default=None)
    args, rest = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    if args.mode == "report":
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        report = {key: os.environ.get(key) for key in keys}
        report.update(local_rank_arg=args.local_rank, argv=sys.argv[1:], rest=rest)
        # One write per line: two ranks share the pipe, and print() writes text and newline apart.
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    elif args.mode == "follow":
        from deepspeed.launcher.launch import follow_launcher

        follow_launcher()
        write(os.path.join(args.dir, f"rank{rank}.pid"), str(os.getpid()))
        time.sleep(60)
    elif args.mode == "fail":
        pid_file = os.path.join(args.dir, "rank0.pid")
        if rank == 0:
            write(pid_file, str(os.getpid()))
            time.sleep(60)
        else:
            wait_for(pid_file)
            sys.exit(3)
    else:

        def on_term(signum, _frame):
            write(os.path.join(args.dir, f"rank{rank}.got"), str(signum))
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        write(os.path.join(args.dir, f"rank{rank}.ready"), "")
        time.sleep(60)


if __name__ == "__main__":
    main()
