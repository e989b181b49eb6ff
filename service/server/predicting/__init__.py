"""``batchserve predict``: a file of inputs answered by the engine in this process.

The rows of an input file (``sources``) go to the same ``Engine``, batcher and handler as
``/predict`` requests, a chunk of rows as one request (``rows``). A feeder thread reads and
prepares the chunks and writes their answers (``feeder``), a bounded window of chunks in
flight, while the event loop runs only the engine (``run``); the answers are written in input
order as JSON Lines, one record per row (``output_file``), with a progress line on stderr
(``progress``).
"""
