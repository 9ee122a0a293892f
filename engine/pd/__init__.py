"""The pd tier of the KV engine: a prefiller's chunks out to a decoder's pd_buffer, and back into
the decoder's paged cache.

- :class:`~kvferry.engine.pd.producer.PDProducer` (prefiller worker, producer.py):
  reserves the decoder's pages when the prompt is first scheduled and writes its chunks as they
  are computed; the forward pass never waits on the network.
- :class:`~kvferry.engine.pd.consumer.PDConsumer` (decoder worker, consumer.py): runs the receiver, waits (bounded by
  ``pd_kv_ready_timeout``) for each expected transfer without blocking other requests, checks
  that the chunk keys match the decoder's own prompt, scatters the chunks into the request's
  blocks and frees the pages.

Neither knows vLLM: the connector maps vLLM's requests and blocks onto these calls.
"""
