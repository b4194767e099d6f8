//! The data side of `tdrv-smi`: where tdrv's statistics come from
//! ([`collect`]), how the kernel's text is read ([`parse`]), and the
//! stable JSON documents ([`model`]), and the CDI spec for containers
//! ([`cdi`]). The binary adds the command line,
//! the text tables and the live view.

pub mod cdi;
pub mod collect;
pub mod model;
pub mod parse;
