#include "kvchat/radix_tree.h"

#include <gtest/gtest.h>

namespace kvchat {
namespace {

using Ids = std::vector<int64_t>;

TokenRadixTree::Match common(const TokenRadixTree& t, const Ids& prompt,
                             const TokenRadixTree::Accept& accept = {}) {
  return t.longest_common_prefix(prompt.data(), static_cast<int64_t>(prompt.size()), accept);
}

TokenRadixTree::Match stored(const TokenRadixTree& t, const Ids& prompt) {
  return t.longest_stored_prefix(prompt.data(), static_cast<int64_t>(prompt.size()));
}

TEST(TokenRadixTree, LongestCommonPrefixAcrossSplitEdges) {
  TokenRadixTree t;
  t.insert("a", {1, 2, 3, 4, 5});
  t.insert("b", {1, 2, 3, 9});  // splits a's edge after 3
  t.insert("c", {7});
  EXPECT_EQ(common(t, {1, 2, 3, 4, 0}).length, 4);
  EXPECT_EQ(common(t, {1, 2, 3, 4, 0}).key, "a");
  EXPECT_EQ(common(t, {1, 2, 3, 9, 9}).key, "b");
  EXPECT_EQ(common(t, {1, 2, 8}).length, 2);
  EXPECT_EQ(common(t, {5}).length, 0);
  EXPECT_EQ(t.size(), 3u);
}

TEST(TokenRadixTree, AcceptFiltersKeys) {
  TokenRadixTree t;
  t.insert("self", {1, 2, 3, 4});
  t.insert("other", {1, 2, 5});
  const auto not_self = [](const std::string& key) { return key != "self"; };
  const auto match = common(t, {1, 2, 3, 4}, not_self);
  EXPECT_EQ(match.length, 2);
  EXPECT_EQ(match.key, "other");
}

TEST(TokenRadixTree, StoredPrefixMustMatchWhole) {
  TokenRadixTree t;
  t.insert("short", {1, 2});
  t.insert("long", {1, 2, 3, 4});
  EXPECT_EQ(stored(t, {1, 2, 3, 4, 5}).key, "long");
  EXPECT_EQ(stored(t, {1, 2, 3}).key, "short");  // "long" is only partly there
  EXPECT_EQ(stored(t, {1, 2, 3}).length, 2);
  EXPECT_EQ(stored(t, {9}).key, "");
}

TEST(TokenRadixTree, EraseAndReplace) {
  TokenRadixTree t;
  t.insert("a", {1, 2, 3});
  t.insert("b", {1, 2, 4});
  t.erase("a");
  EXPECT_FALSE(t.contains("a"));
  EXPECT_EQ(common(t, {1, 2, 3}).key, "b");
  EXPECT_EQ(common(t, {1, 2, 3}).length, 2);
  t.insert("b", {5, 6});  // replaces b's ids
  EXPECT_EQ(common(t, {1, 2}).length, 0);
  EXPECT_EQ(common(t, {5, 6}).length, 2);
  t.erase("missing");  // no-op
  EXPECT_EQ(t.size(), 1u);
}

}  // namespace
}  // namespace kvchat
