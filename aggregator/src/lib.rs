//! Ballast aggregator library.
