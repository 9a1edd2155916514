"""Periodic snapshots: a systemd timer where systemd runs the machine, /etc/cron.d otherwise.

Nothing a user typed goes into a cron or unit file. `schedule add` checks every argument
with the validators `dump` uses (gpusnap/ops/validate.py, gpusnap/ops/cronexpr.py), records them in a
root-only JSON spec (/etc/gpusnap/schedules/NAME.json, with the job owner's uid), and the
cron line or timer runs only `gpusnap schedule run NAME --config-dir DIR`: a name of
[A-Za-z0-9_-] and paths checked to need no quoting, so neither a newline nor cron's `%`
can reach the command. `schedule run` reads the spec, finds the job among its owner's
processes only, dumps with retention, and appends one timestamped JSON line (outcome and
figures) to /var/log/gpusnap/schedule-NAME.log, which `schedule ls` and `doctor` read back:
last run, result, next run, and a job gone for several runs in a row.

record.py: the spec (write, load, list); backends.py: systemd or cron, their files;
manage.py: `add` and `rm`; runlog.py: `schedule run`, its log, status and doctor's checks;
inflight.py: the marker of a run under way, and runs killed without a word.
"""

from gpusnap.ops.schedule.record import (Schedule, SPEC_VERSION, gpusnap_executable, list_schedules, load,  # noqa: F401
                                         log_dir, spec_dir)
from gpusnap.ops.schedule.backends import (CRON_DAEMONS, MARK, PREFIX, Probes, cron_dir, detect_scheduler,  # noqa: F401
                                           probes, require_scheduler, scheduler_fix, systemd_dir)
from gpusnap.ops.schedule.manage import add, remove  # noqa: F401
from gpusnap.ops.schedule.runlog import (GONE_AFTER, append_log, current_job, doctor_checks, next_run,  # noqa: F401
                                         read_log, run, status)
