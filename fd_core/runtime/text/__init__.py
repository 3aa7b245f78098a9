"""Text in and out: tokenizers, chat templates, a checkpoint's generation settings, and streamed decoding."""
