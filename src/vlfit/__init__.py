"""vlfit: fine-tune vision-language models on image-text data with an input pipeline that keeps the device fed."""

__version__ = "0.1.0"
