//! Ballast agent library.
