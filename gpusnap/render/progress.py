"""The progress bar's byte columns, in the binary units every other line of gpusnap prints
(render.human_bytes): rich's own columns say GB and MB/s, the summaries GiB."""

from __future__ import annotations

from rich.progress import ProgressColumn
from rich.text import Text

from gpusnap.render import human_bytes


class BytesColumn(ProgressColumn):
    """'1.2 GiB/4.0 GiB' (or just what is done while the total is unknown)."""

    def render(self, task) -> Text:
        done = human_bytes(int(task.completed))
        return Text(f"{done}/{human_bytes(int(task.total))}" if task.total else done, style="progress.download")


class SpeedColumn(ProgressColumn):
    """'512.0 MiB/s'."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")
