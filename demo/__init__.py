"""`make demo`: the product's main job end to end on the local Postgres and Kafka.

`python -m demo` (see demo/run.py). demo/app.py is the example application (one fan-out in one
transaction); demo/consumer.py is the example consumer (process items, ack them through the ack
topic).
"""
