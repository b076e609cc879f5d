"""A consumed Kafka message without Kafka, for the fold's unit tests."""

from __future__ import annotations


class Msg:
    """What fold_messages reads of a consumed confluent_kafka.Message."""

    def __init__(self, value, offset, headers=None, key=b"1", partition=0):
        self._v, self._o, self._h, self._k, self._p = value, offset, headers, key, partition

    def error(self):
        return None

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def key(self):
        return self._k

    def value(self):
        return self._v

    def headers(self):
        return self._h
