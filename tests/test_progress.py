import io

from mlx_dspark.progress import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_and_is_quiet_otherwise():
    for stream, drawn in ((Terminal(), True), (io.StringIO(), False)):
        for _ in progress(range(3), desc="job", file=stream):
            pass
        assert ("job" in stream.getvalue()) == drawn
