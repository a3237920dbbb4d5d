"""Fake `ssh`, `pdsh`, `mpirun` and `srun` for the fake-cluster launcher tests.

    python fake_cluster.py TOOL ARGS...      (the test puts `TOOL` wrappers first on PATH)

Every call appends `{"tool": ..., "argv": [...]}` to $FAKE_CLUSTER_LOG, so a test can check the
command lines our runners built, and then does what the real tool would do, on this machine:

ssh     "Logs in" to a host of $FAKE_CLUSTER_HOSTS (another name fails like an unknown host):
        runs the command words, joined by spaces, with `bash -c` in $HOME and a bare login
        environment (PATH, HOME, FAKE_CLUSTER_HOST), so only what the command exports reaches
        the ranks. The remote command runs in its own session with stdin piped from this
        client, as under sshd: ending this client closes the remote stdin and nothing else.
pdsh    Runs `ssh [$PDSH_SSH_ARGS_APPEND] host command` for each host of `-w`, in parallel, with
        `%n` replaced by the host's index and `%h` by its name; prefixes output with `host: `;
        with -S exits with the largest remote exit code.
mpirun  Open MPI syntax (`-n`, `--hostfile`, `-x NAME=value`) or Hydra syntax (`-n`, `-ppn`,
        `-genv NAME value`, `-hosts a,b`): starts every rank with the bare environment plus the
        exported variables and the launcher's own (OMPI_COMM_WORLD_* or PMI_* / MPI_LOCAL*);
        when one rank fails, kills the others and exits with its code.
srun    `-n`, `--nodes`, `--ntasks-per-node`, `--nodelist`, `--kill-on-bad-exit`, `--export=ALL`:
        starts the tasks with srun's environment plus SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
        SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

SSH_OPTIONS_WITH_VALUE = set("bcDEeFIiJLlmOopQRSWw")


def log_call(tool, argv):
    path = os.environ.get("FAKE_CLUSTER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"tool": tool, "argv": argv}) + "\n")


def known_hosts():
    return os.environ.get("FAKE_CLUSTER_HOSTS", "").split(",")


def bare_env(host):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "FAKE_CLUSTER_HOST": host}
    env.update({k: v for k, v in os.environ.items() if k.startswith("FAKE_CLUSTER_")})
    env["FAKE_CLUSTER_HOST"] = host
    return env


# ----------------------------------------------------------------------------- ssh and pdsh


def ssh(argv):
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i][1:] in SSH_OPTIONS_WITH_VALUE else 1
    host, command = argv[i], " ".join(argv[i + 1 :])
    if host not in known_hosts():
        sys.stderr.write(f"ssh: Could not resolve hostname {host}: Name or service not known\n")
        return 255
    remote = subprocess.Popen(
        ["/bin/bash", "-c", command],
        stdin=subprocess.PIPE,
        env=bare_env(host),
        cwd=os.environ["HOME"],
        start_new_session=True,
    )

    def relay():  # our stdin -> the remote stdin, until either side closes
        try:
            while True:
                data = os.read(0, 4096)
                if not data:
                    break
                remote.stdin.write(data)
                remote.stdin.flush()
        except OSError:
            pass

    threading.Thread(target=relay, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(255))  # a dropped connection: the remote lives on
    return remote.wait()


def pdsh(argv):
    hosts, strict, i = [], False, 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "-S":
            strict, i = True, i + 1
        elif flag == "-w":
            hosts, i = argv[i + 1].split(","), i + 2
        elif flag in ("-f", "-R", "-l", "-u", "-t"):
            i += 2
        else:
            i += 1
    command = " ".join(argv[i:])
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    procs = []
    for index, host in enumerate(hosts):
        remote = command.replace("%n", str(index)).replace("%h", host)
        proc = subprocess.Popen(
            ["ssh", *extra, host, remote],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=prefix_lines, args=(proc, host), daemon=True).start()
        procs.append(proc)

    def stop(*_):
        for proc in procs:
            proc.terminate()
        os._exit(255)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    codes = [proc.wait() for proc in procs]
    time.sleep(0.1)  # let the prefixing threads drain
    return max(codes) if strict else 0


def prefix_lines(proc, host):
    for line in proc.stdout:
        sys.stdout.write(f"{host}: {line}")
        sys.stdout.flush()


# ----------------------------------------------------------------------------- mpirun and srun


def run_tasks(tasks, program):
    """Start `(env)` per task running `program`; on the first failure kill the rest."""
    procs = [subprocess.Popen(program, env=env, start_new_session=True) for env in tasks]

    def kill_all(*_):
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_signal(signum, _frame):
        kill_all()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            kill_all()
            for proc in procs:
                proc.wait()
            sys.stderr.write(f"fake launcher: a task exited with code {failed[0]}; killed the others\n")
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def read_openmpi_hostfile(path):
    hosts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                host, slots = line.split()
                hosts.append((host, int(slots.split("=")[1])))
    return hosts


def mpirun(argv):
    hydra = any(a in ("-ppn", "-genv", "-hosts") for a in argv)
    total, per_node, hosts, exports, i = 0, 0, [], {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag in ("-n", "-np"):
            total, i = int(argv[i + 1]), i + 2
        elif flag == "-ppn":
            per_node, i = int(argv[i + 1]), i + 2
        elif flag in ("--hostfile", "-hostfile"):
            hosts, i = read_openmpi_hostfile(argv[i + 1]), i + 2
        elif flag == "-hosts":
            names, i = argv[i + 1].split(","), i + 2
        elif flag == "-x":
            name, _, value = argv[i + 1].partition("=")
            exports[name], i = value, i + 2
        elif flag in ("-genv", "-env"):
            exports[argv[i + 1]], i = argv[i + 2], i + 3
        elif flag == "--mca":
            i += 3
        else:
            i += 1
    if hydra:
        hosts = [(name, per_node) for name in names]
    tasks, rank = [], 0
    for node, (host, slots) in enumerate(hosts):
        for local in range(slots):
            env = {**bare_env(host), **exports}
            if hydra:
                env.update(PMI_RANK=rank, PMI_SIZE=total, MPI_LOCALRANKID=local, MPI_LOCALNRANKS=slots)
            else:
                env.update(
                    OMPI_COMM_WORLD_RANK=rank,
                    OMPI_COMM_WORLD_SIZE=total,
                    OMPI_COMM_WORLD_LOCAL_RANK=local,
                    OMPI_COMM_WORLD_LOCAL_SIZE=slots,
                    OMPI_COMM_WORLD_NODE_RANK=node,
                )
            tasks.append({k: str(v) for k, v in env.items()})
            rank += 1
    if rank != total:
        sys.stderr.write(f"fake mpirun: -n {total}, but the hosts offer {rank} slots\n")
        return 1
    return run_tasks(tasks, argv[i:])


def srun(argv):
    total, nodes, per_node, nodelist, i = 0, 0, 0, None, 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "-n":
            total, i = int(argv[i + 1]), i + 2
        elif flag in ("--nodes", "-N"):
            nodes, i = int(argv[i + 1]), i + 2
        elif flag == "--ntasks-per-node":
            per_node, i = int(argv[i + 1]), i + 2
        elif flag in ("--nodelist", "-w"):
            nodelist, i = argv[i + 1].split(","), i + 2
        else:
            i += 1
    nodelist = nodelist or known_hosts()[:nodes]
    if total != nodes * per_node or len(nodelist) != nodes:
        sys.stderr.write(f"fake srun: inconsistent -n {total} --nodes {nodes} --ntasks-per-node {per_node}\n")
        return 1
    tasks = []
    for node, host in enumerate(nodelist):
        for local in range(per_node):
            env = dict(os.environ, FAKE_CLUSTER_HOST=host)  # --export=ALL
            env.update(
                SLURM_PROCID=str(node * per_node + local),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node),
                SLURM_NTASKS=str(total),
                SLURM_STEP_NUM_TASKS=str(total),
                SLURM_STEP_NODELIST=",".join(nodelist),
                SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})",
            )
            tasks.append(env)
    return run_tasks(tasks, argv[i:])


TOOLS = {"ssh": ssh, "pdsh": pdsh, "mpirun": mpirun, "srun": srun}

if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    log_call(tool, args)
    sys.exit(TOOLS[tool](args))
