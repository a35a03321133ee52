"""The SDK's retry policy (gtr_client/retry.py) and its reading of the server's hint
(gtr_client/errors.py), as properties: what is sent again, never sooner than the server
asked, never past the deadline, never more than the attempts and the budget allow."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gtr_client import errors
from gtr_client.retry import RETRY_UNAVAILABLE, Retrier, RetryBudget, RetryPolicy

METHODS = ["Search", "BatchSearch", "Get", "Upsert", "Delete", "Check"]
policies = st.builds(
    RetryPolicy,
    attempts=st.integers(1, 8),
    initial_backoff_s=st.floats(0.001, 1.0),
    max_backoff_s=st.just(2.0),
    multiplier=st.floats(1.0, 3.0),
    hint_jitter=st.floats(0.0, 0.5),
)
remaining = st.one_of(st.none(), st.floats(0.0, 30.0))
draws = st.floats(0.0, 0.999999)


@given(
    policies,
    st.sampled_from(METHODS),
    st.floats(0.0, 5.0),
    st.integers(1, 8),
    remaining,
    draws,
)
def test_a_refusal_with_a_hint_is_retried_for_any_method_never_sooner_than_the_hint(
    policy: RetryPolicy,
    method: str,
    hint: float,
    attempt: int,
    left: float | None,
    draw: float,
) -> None:
    """The gateway refuses over its in-flight limit before any work: a write too may be
    sent again, after the hint (jittered upwards only), if that still ends in time."""
    refused = errors.ResourceExhausted("busy", retry_after_s=hint)
    pause = policy.pause(method, refused, attempt, left, lambda: draw)
    wanted = hint * (1 + policy.hint_jitter * draw)
    if attempt >= policy.attempts or (left is not None and wanted >= left):
        assert pause is None
    else:
        assert pause is not None and hint <= pause <= hint * (1 + policy.hint_jitter)


@given(policies, st.sampled_from(METHODS), st.integers(1, 8), remaining)
def test_a_refusal_without_a_hint_or_with_do_not_retry_is_raised(
    policy: RetryPolicy, method: str, attempt: int, left: float | None
) -> None:
    full = errors.error_for("RESOURCE_EXHAUSTED", "store full", [("grpc-retry-pushback-ms", "-1")])
    assert isinstance(full, errors.ResourceExhausted) and full.retry_after_s is None
    assert policy.pause(method, full, attempt, left) is None
    assert policy.pause(method, errors.ResourceExhausted("no hint"), attempt, left) is None


@given(policies, st.sampled_from(METHODS), st.integers(1, 8), remaining, draws)
def test_unavailable_is_retried_with_bounded_backoff_except_for_a_delete(
    policy: RetryPolicy, method: str, attempt: int, left: float | None, draw: float
) -> None:
    pause = policy.pause(method, errors.Unavailable("down"), attempt, left, lambda: draw)
    if method == "Delete" or attempt >= policy.attempts:
        assert pause is None
        return
    ceiling = min(
        policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier ** (attempt - 1)
    )
    if left is not None and ceiling * draw >= left:
        assert pause is None
    else:
        assert pause is not None and 0 <= pause <= ceiling


def test_only_delete_is_kept_from_retries_after_unavailable() -> None:
    assert set(METHODS) - RETRY_UNAVAILABLE == {"Delete"}


@pytest.mark.parametrize(
    "code",
    [
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "DEADLINE_EXCEEDED",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "FAILED_PRECONDITION",
        "INTERNAL",
        "CANCELLED",
    ],
)
def test_no_other_status_is_retried(code: str) -> None:
    error = errors.error_for(code, "no", [("retry-after-ms", "10")])
    for method in METHODS:
        assert RetryPolicy().pause(method, error, 1, None) is None


def test_each_status_has_its_exception_and_a_rare_one_keeps_its_code() -> None:
    cases = {
        "INVALID_ARGUMENT": errors.InvalidArgument,
        "NOT_FOUND": errors.NotFound,
        "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
        "UNAVAILABLE": errors.Unavailable,
        "DEADLINE_EXCEEDED": errors.DeadlineExceeded,
        "UNAUTHENTICATED": errors.Unauthenticated,
        "PERMISSION_DENIED": errors.PermissionDenied,
        "FAILED_PRECONDITION": errors.FailedPrecondition,
        "CANCELLED": errors.Cancelled,
        "INTERNAL": errors.InternalError,
        "UNKNOWN": errors.InternalError,
    }
    for code, cls in cases.items():
        error = errors.error_for(code, "why", method="Search", attempts=3)
        assert type(error) is cls and error.code == code
        assert str(error) == f"{code}: why (Search, 3 attempts)"
    other = errors.error_for("ALREADY_EXISTS", "x")
    assert type(other) is errors.ApiError and other.code == "ALREADY_EXISTS"
    assert str(other) == "ALREADY_EXISTS: x"


@pytest.mark.parametrize(
    ("trailing", "seconds"),
    [
        ([("retry-after-ms", "250"), ("grpc-retry-pushback-ms", "250")], 0.25),
        ([("retry-after-ms", b"1500")], 1.5),
        ([("grpc-retry-pushback-ms", "40")], 0.04),
        ([("grpc-retry-pushback-ms", "-1")], None),
        ([("retry-after-ms", "100"), ("grpc-retry-pushback-ms", "-1")], None),
        ([("retry-after-ms", "soon")], None),
        ([], None),
    ],
)
def test_the_servers_hint_is_read_from_the_trailing_metadata(
    trailing: list[tuple[str, str | bytes]], seconds: float | None
) -> None:
    assert errors.retry_after(trailing) == seconds


@given(st.integers(1, 50), st.integers(0, 200))
def test_the_budget_stops_retries_when_most_calls_fail_and_successes_restore_it(
    failures: int, successes: int
) -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=0.1)
    allowed = [budget.failure() for _ in range(failures)]
    # 10 tokens, one per failure, retries while more than 5 are left: the first 4
    assert allowed == [i < 4 for i in range(failures)]
    for _ in range(successes):
        budget.success()
    assert budget.tokens == pytest.approx(min(10.0, max(0.0, 10.0 - failures) + successes * 0.1))


def test_the_retrier_asks_the_budget_only_for_what_the_policy_would_retry() -> None:
    retrier = Retrier(RetryPolicy(), RetryBudget(max_tokens=4, token_ratio=1))
    assert retrier.after_failure("Get", errors.NotFound("x"), 1, None) is None
    assert retrier.budget.tokens == 4  # a failure nobody would retry costs nothing
    down = errors.Unavailable("x")
    assert retrier.after_failure("Get", down, 1, None) is not None  # 3 left
    assert retrier.after_failure("Get", down, 1, None) is None  # 2: half, throttled
    retrier.after_success()
    retrier.after_success()
    assert retrier.after_failure("Get", down, 1, None) is not None


def test_policy_values_are_checked() -> None:
    for bad in (
        {"attempts": 0},
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 3.0, "max_backoff_s": 2.0},
        {"multiplier": 0.5},
        {"hint_jitter": -1},
    ):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]
