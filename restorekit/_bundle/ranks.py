"""The ranks of a torch.distributed process group writing one output: who writes which file, and the exchanges at which a failure on any rank stops every rank.

The shape is torch's ``distributed/checkpoint``: every rank computes the same plan, each
writes its part into the one staging directory, rank 0 gathers what each wrote and
finishes with the one commit (``staging.Staging``). Every collective here is an
``all_gather_object`` of a status and a payload (``Ranks.exchange``), made by every rank
in the same order, so a rank that raises joins the exchange the others wait in with its
failure (``Ranks.run``) and every rank raises ``RankFailedError`` naming it. A rank that
is killed breaks the group: the others' collective fails (gloo sees the connection close,
or its timeout passes) and they name the rank whose process is gone. torch is imported
here only, inside functions: ``import restorekit`` never imports it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import time

from restorekit.errors import MissingDependencyError, OptionNotApplicableError, RankFailedError, RestoreKitError

__all__ = ["TIMEOUT_ENV", "Ranks", "assign", "distribute", "first_host", "launched_size", "splittable"]

# Seconds a collective waits for the other ranks when restorekit starts the group itself (the
# CLI under torchrun or srun); a group the caller started keeps the timeout it was given.
TIMEOUT_ENV = "RESTOREKIT_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT = 600.0


def assign(nbytes: list[int], size: int) -> list[int]:
    """The rank that writes each file of ``nbytes`` bytes: the largest first, each to the rank with the fewest
    bytes so far (the lowest rank on a tie), so every rank computes the same answer."""
    load = [0] * size
    owner = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += nbytes[i]
    return owner


def distribute(out, work, *, to: str, sharded: bool):
    """``work(ranks)`` across the ranks of the process group (``Ranks.join``), else ``work(None)`` in a group of one:
    what ``distributed=True`` means for every command that takes it (``convert``, ``average``, ``merge``).

    Only a safetensors shard set can be split: for any other output (``to``, ``sharded`` False) the option is
    refused before the group is joined or anything is written.

    Raises:
        OptionNotApplicableError: the output is not a safetensors shard set.
        MissingDependencyError: torch is not installed.
        RankFailedError: a rank failed or was killed (it is named); nothing was published.
    """
    splittable(to, sharded=sharded)
    ranks = Ranks.join(output=out)
    if ranks is None:
        return work(None)
    return ranks.run(lambda: work(ranks))


def splittable(to: str, *, sharded: bool) -> None:
    """Refuse ``distributed`` for an output ``to`` that is not a safetensors shard set (no torch import).

    Raises:
        OptionNotApplicableError: with ``option='distributed'``.
    """
    if to != "safetensors" or not sharded:
        raise OptionNotApplicableError("distributed", f"{to} (unsharded)" if to == "safetensors" else to,
                                       ("safetensors with max_shard_size",), value=True)


def _launch_env() -> tuple[int, int] | None:
    """(rank, world size) a launcher gave this process: torchrun's ``RANK`` / ``WORLD_SIZE``, else SLURM's
    ``SLURM_PROCID`` / ``SLURM_NTASKS`` in a task ``srun`` started (``SLURM_STEP_NUM_TASKS`` set) or with
    ``MASTER_ADDR`` set; None without either. A batch script itself (no step, rank 0 of the job's tasks) is
    no rank: a command there runs alone."""
    env = os.environ
    try:
        if "WORLD_SIZE" in env and "RANK" in env:
            return int(env["RANK"]), int(env["WORLD_SIZE"])
        in_step = "SLURM_STEP_NUM_TASKS" in env or "MASTER_ADDR" in env
        if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and in_step and _slurm_master() is not None:
            return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    except ValueError:
        return None
    return None


def _slurm_master() -> tuple[str, int] | None:
    """Where rank 0 of a SLURM job listens: ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else the first host of the
    job step's node list and a port every task of the job derives alike from ``SLURM_JOB_ID`` (15000 + the id
    modulo 20000); None when neither says the host."""
    env = os.environ
    host = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                                or env.get("SLURM_NODELIST") or "")
    if not host:
        return None
    try:
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    except ValueError:
        return None
    return host, port


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list, as ``scontrol show hostnames`` lists it first:
    ``'node[003-010,020],gpu5'`` -> ``'node003'``, ``'rack[1-2]-n[07,09]'`` -> ``'rack1-n07'``; None for ''."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], nodelist[:end].strip())
    return first or None


def launched_size() -> int:
    """How many ranks a launcher (torchrun, srun) started this process among; 1 when none did. No torch import."""
    found = _launch_env()
    return found[1] if found is not None else 1


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError:
        raise MissingDependencyError("distributed=True runs across the ranks of a torch.distributed process "
                                     "group and needs torch: pip install 'restorekit[torch]'") from None
    if not dist.is_available():
        raise MissingDependencyError("this torch build has no torch.distributed; install a build with it "
                                     "(pip install 'restorekit[torch]')")
    return dist


def _timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def _gone(pid: int) -> bool:
    """True once process ``pid`` is dead (a zombie not yet reaped by its launcher counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _describe(error: BaseException) -> str:
    text = str(error) or "no message"
    return f"{type(error).__name__}: {text}"


class _Broken(Exception):
    """A collective failed: the group can take no further exchange."""


class Ranks:
    """This process's place among the ranks writing one output, and the exchanges they make.

        ranks = Ranks.join(output='out/')      # None: a group of one, write as one process
        result = ranks.run(lambda: write(..., ranks=ranks))
    """

    def __init__(self, dist, group, *, output, owned: bool):
        self._dist, self._group, self._owned = dist, group, owned
        self.output = os.fspath(output)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.stage = "starting"
        self.published = False  # rank 0 sets it once its commit has published the output
        self._broken = False
        self._finished = False
        self.peers = self.exchange("starting", (os.getpid(), socket.gethostname()))
        self.stage = "planning"

    @classmethod
    def join(cls, *, output) -> "Ranks | None":
        """The ranks of the process group this process is in: the one the caller started, else one started here
        with the gloo backend from torchrun's (or SLURM's) variables; None for a group of one.

        Raises:
            MissingDependencyError: torch is not installed.
        """
        dist = _torch_distributed()
        owned = False
        if not dist.is_initialized():
            found = _launch_env()
            if found is None or found[1] <= 1:
                return None
            rank, size = found
            # torchrun's variables are read by env://; srun's tasks meet where _slurm_master says.
            master = _slurm_master() if "RANK" not in os.environ else None
            dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=_timeout()),
                                    init_method=f"tcp://{master[0]}:{master[1]}" if master else None)
            owned = True
        if dist.get_world_size() <= 1:
            if owned:
                dist.destroy_process_group()
            return None
        # Objects travel over gloo on the CPU; a caller's NCCL group gets a gloo group beside it (every rank makes it).
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        try:
            return cls(dist, group, output=output, owned=owned)
        except BaseException:
            if owned:
                dist.destroy_process_group()
            raise

    # ------------------------------------------------------------------ exchanges
    def at(self, stage: str) -> None:
        """Name the step this rank is at: a failure reports it."""
        self.stage = stage

    def exchange(self, stage: str, payload=None) -> list:
        """Every rank's ``payload`` in rank order, once every rank reached ``stage`` well.

        Raises:
            RankFailedError: a rank reported a failure instead, or was killed, or did not answer within the
                group's timeout.
        """
        self.stage = stage
        return [body for _, body in self._all_gather(("ok", payload))]

    def _all_gather(self, message) -> list:
        if self._broken:
            raise RankFailedError(path=self.output, rank=None, stage=self.stage, cause="the group broke earlier",
                                  published=self._outcome())
        out: list = [None] * self.size
        try:
            self._dist.all_gather_object(out, message, group=self._group)
        except Exception as e:  # gloo: a peer closed its connection (killed) or the timeout passed
            self._broken = True
            raise RankFailedError(path=self.output, rank=self._dead_rank(), stage=self.stage,
                                  cause=f"it stopped answering ({_describe(e)})", published=self._outcome()) from e
        failed = [(r, body) for r, (status, body) in enumerate(out) if status != "ok"]
        if failed:
            rank, (stage, cause) = failed[0]
            self._failed_ranks = [r for r, _ in failed]
            raise RankFailedError(path=self.output, rank=rank, stage=stage, cause=cause)
        return out

    def _outcome(self) -> bool | None:
        """What a rank knows of the output when the group breaks: rank 0 whether it published it; the others,
        while rank 0 publishes, nothing (None: complete or absent); before that, that nothing was published."""
        if self.published:
            return True
        return None if self.stage == "publishing" and self.rank != 0 else False

    def _dead_rank(self) -> int | None:
        """The rank whose process is gone (on this host), looked for for up to 2 s while its launcher reaps it."""
        host = socket.gethostname()
        deadline = time.monotonic() + 2.0
        while True:
            for rank, (pid, peer_host) in enumerate(getattr(self, "peers", None) or ()):
                if rank != self.rank and peer_host == host and _gone(pid):
                    return rank
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def run(self, work):
        """``work()`` on this rank; its exception is reported at the exchange the other ranks wait in.

        When every rank fails at the same exchange (the same bad input everywhere) each raises its own error;
        otherwise every rank raises ``RankFailedError`` naming the first rank that failed. A group started
        by ``join`` is destroyed at the end.
        """
        try:
            return work()
        except RankFailedError:  # an exchange failed: every rank knows
            raise
        except BaseException as e:
            raise self._report(e) from e
        finally:
            self._finished = True
            if self._owned:
                with contextlib.suppress(Exception):
                    self._dist.destroy_process_group()

    def _report(self, error: BaseException) -> BaseException:
        """Join the other ranks' next exchange with ``error``; the error this rank then raises."""
        stage = self.stage
        if self._broken or self._finished:
            return RankFailedError(path=self.output, rank=self.rank, stage=stage, cause=_describe(error))
        try:
            self._all_gather(("failed", (stage, _describe(error))))
        except RankFailedError as reported:
            if isinstance(error, RestoreKitError) and getattr(self, "_failed_ranks", []) == list(range(self.size)):
                return error  # every rank refused alike: the plain error, as one process raises it
            if reported.rank is not None and reported.rank != self.rank:
                return reported
        return RankFailedError(path=self.output, rank=self.rank, stage=stage, cause=_describe(error))
