"""Data in and out of the outside world: trace/feedback schema, Kafka source
and sink, the Arrow reward buffer, dead-letter store, replay readers."""
