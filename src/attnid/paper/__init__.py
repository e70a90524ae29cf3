"""The paper's reproduction (arXiv:2609.01231), built on the attnid library.

Nothing in the library imports this package: it owns ``attnid reproduce`` and ``attnid
experiment`` (registered through the ``attnid.commands`` entry point), the training
experiments (`experiment`, `drift`), the pretrained-encoder section (`contrastive`,
`pretrained`), and the report's document model (`document`).
"""
