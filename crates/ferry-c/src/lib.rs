//! Ferry's C interface (implementation follows the headers in include/).
