"""The book and the page: the course as a website, and the model in the browser.

- :mod:`attn.site.book`: ``python -m attn.site.book`` executes the lessons into a Sphinx site
  (``build/book/html/``).
- :mod:`attn.site.export`: ``attn-export CHECKPOINT DIR``, a trained model in the format the
  page in ``web/`` reads (``docs/WEB_FORMAT.md``), and :func:`~attn.site.export.load_export` back.
- :mod:`attn.site.browser`: ``web/`` served on 127.0.0.1 and opened in the system's headless
  Chromium, for the tests, and ``python -m attn.site.browser measure``.

The course (``attn.model``, the layers, decoding, training, ...) never imports this package.
"""
