//! Tensor sets: named collections of tensors (nrt's `nrt_tensor_set_t`).

use std::collections::HashMap;

use crate::tensor::Tensor;

/// A map from name to tensor. It holds a reference to each tensor, so a
/// tensor stays valid while it is in a set.
#[derive(Debug, Default, Clone)]
pub struct TensorSet {
    tensors: HashMap<String, Tensor>,
}

impl TensorSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `tensor` under `name`, returning the tensor it replaces.
    pub fn add(&mut self, name: &str, tensor: Tensor) -> Option<Tensor> {
        self.tensors.insert(name.to_owned(), tensor)
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// Takes the tensor named `name` out of the set.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The (name, tensor) pairs, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }
}
