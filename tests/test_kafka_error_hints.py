"""An init_transactions failure is reported with the hint its error code calls for: a coordinator
still loading or moving is a warning that is retried, never an access-rights hint."""

from __future__ import annotations

from confluent_kafka import KafkaError
from hypothesis import given
from hypothesis import strategies as st

from harvester.publishing.transactional import init_failure

REFUSED = {
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
}
CODES = sorted({v for k, v in vars(KafkaError).items() if k.isupper() and isinstance(v, int)})


@given(st.sampled_from(CODES), st.booleans())
def test_the_access_rights_hint_goes_with_authorisation_codes_only(code, retriable):
    level, event = init_failure(KafkaError(code, retriable=retriable))
    assert ("Write and Describe" in event) == (code in REFUSED), (code, event)
    if code in REFUSED:
        assert level == "error"


def test_a_coordinator_not_ready_is_a_retried_warning():
    for code in (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT):
        level, event = init_failure(KafkaError(code))
        assert level == "warning" and "retried" in event and "Write" not in event, (code, event)


def test_anything_else_is_an_error_without_a_guess():
    level, event = init_failure(ValueError("no KafkaError"))
    assert level == "error" and "Write" not in event
