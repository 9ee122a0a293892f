"""The OpenAI API as the proxy speaks it: request bodies, engine answers, the legs' bodies, merged
answers, errors, JSON, and the streamed chunk rewriter."""
