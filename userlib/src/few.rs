//! [`Few`]: a list that holds its first element inline.
//!
//! Most jobs copy one source to one destination: keeping their one
//! descriptor, input and output without a heap block each saves a job three
//! allocations and three frees. Safe code only: an enum, not a union.

use std::ops::Deref;

/// A list of `T` that stores a single element inline and moves to a `Vec`
/// for a second one.
///
/// ```ignore
/// let mut f = Few::default();
/// f.push(1);
/// assert_eq!(&f[..], &[1]);
/// f.push(2);
/// assert_eq!(&f[..], &[1, 2]);
/// ```
#[derive(Debug, Clone, Default)]
pub(crate) enum Few<T> {
    /// No element, and no heap block.
    #[default]
    Empty,
    /// One element, inline.
    One(T),
    /// The elements in a vector (possibly none after `clear`, which keeps
    /// its room for the next job built in the same `Job`).
    Many(Vec<T>),
}

impl<T> Few<T> {
    /// Appends `v`.
    pub(crate) fn push(&mut self, v: T) {
        if let Few::Many(vec) = self {
            vec.push(v);
            return;
        }
        *self = match std::mem::take(self) {
            Few::Empty => Few::One(v),
            Few::One(first) => {
                let mut vec = Vec::with_capacity(4);
                vec.push(first);
                vec.push(v);
                Few::Many(vec)
            }
            Few::Many(mut vec) => {
                vec.push(v);
                Few::Many(vec)
            }
        };
    }

    /// Removes every element; a vector keeps its room.
    pub(crate) fn clear(&mut self) {
        match self {
            Few::Many(vec) => vec.clear(),
            _ => *self = Few::Empty,
        }
    }
}

impl<T> Deref for Few<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Few::Empty => &[],
            Few::One(v) => std::slice::from_ref(v),
            Few::Many(vec) => vec,
        }
    }
}

impl<'a, T> IntoIterator for &'a Few<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::Few;
    use std::sync::Arc;

    #[test]
    fn grows_from_inline_to_a_vector_in_order() {
        let mut f = Few::default();
        assert!(f.is_empty());
        for i in 0..10 {
            f.push(i);
            assert_eq!(f.len(), i + 1);
            assert_eq!(&f[..], &(0..=i).collect::<Vec<_>>()[..]);
        }
        assert!(matches!(f, Few::Many(_)));
    }

    #[test]
    fn one_element_needs_no_vector() {
        let mut f = Few::default();
        f.push("a");
        assert!(matches!(f, Few::One("a")));
        assert_eq!(f.iter().copied().collect::<Vec<_>>(), vec!["a"]);
    }

    #[test]
    fn clear_keeps_a_vectors_room_and_take_empties() {
        let mut f = Few::default();
        f.push(1);
        f.push(2);
        let cap = match &f {
            Few::Many(v) => v.capacity(),
            _ => unreachable!(),
        };
        f.clear();
        assert!(f.is_empty());
        assert!(matches!(&f, Few::Many(v) if v.capacity() == cap));
        f.push(3);
        let taken = std::mem::take(&mut f);
        assert_eq!(&taken[..], &[3]);
        assert!(matches!(f, Few::Empty));
        let mut g = Few::default();
        g.push(4);
        g.clear();
        assert!(matches!(g, Few::Empty));
    }

    #[test]
    fn elements_drop_exactly_once() {
        let item = Arc::new(());
        let mut f = Few::default();
        f.push(item.clone());
        f.push(item.clone());
        f.push(item.clone());
        assert_eq!(Arc::strong_count(&item), 4);
        let taken = std::mem::take(&mut f);
        assert_eq!(Arc::strong_count(&item), 4);
        drop(taken);
        assert_eq!(Arc::strong_count(&item), 1);
        let mut g = Few::default();
        g.push(item.clone());
        g.clear();
        assert_eq!(Arc::strong_count(&item), 1);
    }
}
