//! `#[derive(ferry::Pod)]` and `#[derive(ferry::Zeroable)]`: the plain-old-data
//! traits of the typed views of buffer memory, implemented through the
//! `bytemuck` that `ferry` re-exports (`::ferry::bytemuck`), so that a crate
//! using Ferry needs no `bytemuck` dependency (nor an attribute naming it)
//! to derive them.
//!
//! The checks are those of bytemuck's own derives, each a compile error:
//!
//! - `Pod`: a struct without generic parameters, `#[repr(C)]` or
//!   `#[repr(transparent)]` (`packed`/`align` may be added), every field
//!   `Pod`, and no padding (its size is the sum of its fields' sizes). The
//!   type must also be `Copy` and `Zeroable` (the trait's supertraits).
//! - `Zeroable`: a struct whose every field is `Zeroable` (the all-zero bit
//!   pattern is valid for it); generic parameters get a `Zeroable` bound.
//!
//! Use them through `ferry`: `#[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]`.
//!
//! ```
//! #[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]
//! #[repr(C)]
//! struct Sample {
//!     time: u64,
//!     value: f32,
//!     channel: u32,
//! }
//! let s = Sample { time: 1, value: 0.5, channel: 3 };
//! assert_eq!(ferry::bytemuck::bytes_of(&s).len(), 16);
//! ```
//!
//! Padding (here three bytes after `a`) is refused:
//!
//! ```compile_fail,E0080
//! #[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]
//! #[repr(C)]
//! struct Padded { a: u8, b: u32 }
//! ```
//!
//! So is a field that is not plain old data:
//!
//! ```compile_fail,E0277
//! #[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]
//! #[repr(C)]
//! struct Flags { on: bool, count: [u8; 3] }
//! ```
//!
//! And a struct whose layout the compiler may choose:
//!
//! ```compile_fail
//! #[derive(Clone, Copy, ferry::Pod, ferry::Zeroable)]
//! struct Unordered { a: u32, b: u32 }
//! ```

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::quote;
use syn::{parse_macro_input, Data, DeriveInput, Error, Fields, Type};

/// Implements `ferry::Pod` (bytemuck's `Pod`) for a `#[repr(C)]` or
/// `#[repr(transparent)]` struct without padding whose fields are all `Pod`.
#[proc_macro_derive(Pod)]
pub fn derive_pod(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    pod(&input).unwrap_or_else(Error::into_compile_error).into()
}

/// Implements `ferry::Zeroable` (bytemuck's `Zeroable`) for a struct whose
/// fields are all `Zeroable`.
#[proc_macro_derive(Zeroable)]
pub fn derive_zeroable(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    zeroable(&input).unwrap_or_else(Error::into_compile_error).into()
}

/// The field types of a struct; anything else is refused.
fn field_types<'a>(input: &'a DeriveInput, derive: &str) -> syn::Result<Vec<&'a Type>> {
    match &input.data {
        Data::Struct(s) => Ok(match &s.fields {
            Fields::Named(f) => f.named.iter().map(|f| &f.ty).collect(),
            Fields::Unnamed(f) => f.unnamed.iter().map(|f| &f.ty).collect(),
            Fields::Unit => Vec::new(),
        }),
        Data::Enum(_) | Data::Union(_) => {
            Err(Error::new_spanned(&input.ident, format!("#[derive({derive})] is for structs only")))
        }
    }
}

/// Whether the struct's `#[repr(...)]` fixes its layout: `C` or
/// `transparent` (with `packed`, `packed(N)` or `align(N)` beside).
fn has_defined_layout(input: &DeriveInput) -> syn::Result<bool> {
    let mut defined = false;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("repr")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("C") || meta.path.is_ident("transparent") {
                defined = true;
            } else if meta.path.is_ident("packed") || meta.path.is_ident("align") {
                if meta.input.peek(syn::token::Paren) {
                    let content;
                    syn::parenthesized!(content in meta.input);
                    content.parse::<syn::LitInt>()?;
                }
            } else {
                return Err(meta.error("#[derive(Pod)] needs #[repr(C)] or #[repr(transparent)]"));
            }
            Ok(())
        })?;
    }
    Ok(defined)
}

fn pod(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let fields = field_types(input, "Pod")?;
    if !input.generics.params.is_empty() {
        // The padding check below needs the field sizes of one concrete type.
        return Err(Error::new_spanned(
            &input.generics,
            "#[derive(Pod)] cannot check a generic struct for padding: implement ferry::bytemuck::Pod by hand",
        ));
    }
    if !has_defined_layout(input)? {
        return Err(Error::new(
            Span::call_site(),
            "#[derive(Pod)] needs #[repr(C)] or #[repr(transparent)]: the layout of other structs is not defined",
        ));
    }
    let name = &input.ident;
    let message = format!("#[derive(Pod)]: {name} has padding bytes, which are not plain old data");
    Ok(quote! {
        // Every field is Pod (a `where` bound on a concrete type is checked
        // where it is written).
        const _: () = {
            fn fields_are_pod() where #(#fields: ::ferry::bytemuck::Pod,)* {}
            // No padding: the struct is exactly its fields.
            assert!(
                ::core::mem::size_of::<#name>() == 0 #(+ ::core::mem::size_of::<#fields>())*,
                #message
            );
        };
        // SAFETY: checked above and by the compiler: the layout is defined
        // (repr(C) or transparent), every field is Pod, there is no padding,
        // and Pod's supertraits (Copy, Zeroable, 'static) are required of
        // the type by the trait itself.
        unsafe impl ::ferry::bytemuck::Pod for #name {}
    })
}

fn zeroable(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let fields = field_types(input, "Zeroable")?;
    let name = &input.ident;
    let mut generics = input.generics.clone();
    for param in generics.type_params_mut() {
        param.bounds.push(syn::parse_quote!(::ferry::bytemuck::Zeroable));
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let mut predicates: Vec<TokenStream2> =
        where_clause.map(|w| w.predicates.iter().map(|p| quote!(#p)).collect()).unwrap_or_default();
    predicates.extend(fields.iter().map(|ty| quote!(#ty: ::ferry::bytemuck::Zeroable)));
    Ok(quote! {
        // SAFETY: every field is Zeroable (the `where` bounds, checked by the
        // compiler), so the all-zero bit pattern is a valid value of each,
        // and therefore of the struct (padding bytes may hold anything).
        unsafe impl #impl_generics ::ferry::bytemuck::Zeroable for #name #ty_generics where #(#predicates,)* {}
    })
}
