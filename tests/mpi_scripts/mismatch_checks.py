"""Checks shared by the scenario modules: an expected error, and the DDP and Horovod mismatch
tests' stop at step 2."""
import re


def assert_stopped_at_step_2(error, finished, last, parameter):
    """Masks moved on rank ``last`` at step 2: this rank finished steps 0 and 1 only, and
    ``error`` (its MaskMismatchError) names step 2, rank ``last`` and ``parameter``."""
    message = str(error)
    assert finished == [0, 1], finished
    assert re.search(rf"ranks disagree on mask\S* .*at step 2; offending ranks: \[{last}\]",
                     message), message
    assert f"rank {last} on " in message, message
    assert f"masks differ from rank 0's for [{parameter!r}]" in message, message


def expect_raise(error_type, fn, *needles):
    """``fn()`` raises ``error_type`` naming every needle; returns the exception."""
    try:
        fn()
    except error_type as exc:
        for needle in needles:
            assert needle in str(exc), (needle, str(exc))
        return exc
    raise AssertionError(f"{error_type.__name__} was not raised")
