"""monitoring"""
