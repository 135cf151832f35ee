"""The benchmarks' shared harness: command line (:mod:`.cli`), environment record (:mod:`.env`),
results files (:mod:`.results`), statistics (:mod:`.stats`), figures (:mod:`.plot`), and the
maintained benchmarks' registry (:mod:`.registry`)."""
