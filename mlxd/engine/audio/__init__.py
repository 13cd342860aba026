"""Audio for speech-to-text and text-to-speech (issue 37); so far the upload decoder."""
