"""Data formats (``register_data_formats``, ``detect_data_format``): one module per row layout."""
