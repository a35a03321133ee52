"""Training the reranker.

``data``
    the first stage's candidates over a BEIR dataset, for training and evaluation.
``trainer``
    CELI / monoBERT / mean-pooling rerankers trained with localized contrastive estimation.
"""
